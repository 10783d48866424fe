"""K3's XTML chat format as a Hugging Face chat template (chat_template.jinja beside this file), so
`AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(...)` renders what k3 trained on."""
from __future__ import annotations

from importlib.resources import files

CHAT_TEMPLATE: str = files("k3.text").joinpath("chat_template.jinja").read_text(encoding="utf-8")
