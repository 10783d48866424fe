"""Images and video as the vision tower takes them: decoding, resizing to the patch grid,
normalizing (image_processor.py), video frames sampled and decoded (video.py). Shared by serving,
the VL trainer and `k3 chat`; imports neither."""
