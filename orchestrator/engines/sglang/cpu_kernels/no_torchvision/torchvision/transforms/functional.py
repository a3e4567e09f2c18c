"""InterpolationMode only, so that modules naming it import; every image function fails by name."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    raise AttributeError(
        f"torchvision.transforms.functional.{name}: the project's torchvision stand-in (SGLang on a CPU, text "
        "only) has no image functions"
    )
