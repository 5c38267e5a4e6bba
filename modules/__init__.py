"""The user API: ``syncbn.modules.nn`` (the layers and converters) and ``syncbn.modules.parallel``."""
if __name__ == "modules":  # the repository's directory imported by its own name: a second copy
    raise ImportError("the repository's modules/ is syncbn.modules: import syncbn (from syncbn import nn)")
from . import nn, parallel

__all__ = ["nn", "parallel"]
