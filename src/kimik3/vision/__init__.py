"""Image preprocessing for the vision tower: `process_images(images) -> VisionInputs` (spec 4.1)."""

from kimik3.vision.processor import (
    ProcessorConfig,
    ResizePlan,
    VisionInputs,
    load_image,
    process_images,
    resize_plan,
)
from kimik3.vision.splice import expand_media_pads

__all__ = ["ProcessorConfig", "ResizePlan", "VisionInputs", "expand_media_pads", "load_image", "process_images",
           "resize_plan"]
