"""User API: ``modules.nn`` (the layers and converters) and ``modules.parallel``."""
from . import nn, parallel

__all__ = ["nn", "parallel"]
