"""K3's native vision encoder, MoonViT-V2 and its projector (DESIGN §7; docs/VISION.md)."""
from k3.model.vision.config import VisionConfig
from k3.model.vision.merge import merged_counts, tpool_merge
from k3.model.vision.model import VisionModel
from k3.model.vision.projector import PatchMergerMLPV2
from k3.model.vision.tower import MoonViT

__all__ = ["MoonViT", "PatchMergerMLPV2", "VisionConfig", "VisionModel", "merged_counts", "tpool_merge"]
