"""MX quantization of the routed experts (DESIGN §9).

- mx.py: MXFP4 (E2M1) / MXFP8 (E4M3, E5M2) block formats with E8M0 scales, OCP floor and K3 ceil rules.
- targets.py: what is quantized (routed experts' w1/w2/w3) and with which format and rule.
- qat.py: `apply_qat(model)`, MXFP4 weights + MXFP8 activations with straight-through gradients.
The packed checkpoint layout and `k3 quantize` live in k3/checkpoint/.
"""
