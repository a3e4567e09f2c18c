"""A stand-in for torchvision in SGLang's CPU environment, put on the path by ../../launch.py only where no real
torchvision loads (PyPI's wheels link CUDA torch). SGLang imports `torchvision.transforms` while loading its
multimodal processors at start-up; the project serves text only, and any use of an image transform fails by name."""

__version__ = "0.0.0+stand-in"
