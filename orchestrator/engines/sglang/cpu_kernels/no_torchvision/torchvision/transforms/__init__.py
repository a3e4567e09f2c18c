"""The names SGLang 0.5.23 imports from torchvision.transforms at start-up; anything else fails by name."""

from torchvision.transforms.functional import InterpolationMode


def __getattr__(name):
    raise AttributeError(
        f"torchvision.transforms.{name}: the project's torchvision stand-in (SGLang on a CPU, text only) has no "
        "image transforms"
    )


__all__ = ["InterpolationMode"]
