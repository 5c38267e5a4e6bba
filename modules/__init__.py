"""User API: ``modules.nn`` (the layers and converters) and ``modules.parallel``."""
if __name__ == "modules":  # the repository's own name for syncbn.modules: the same package (syncbn/_legacy_names.py)
    from syncbn._legacy_names import alias_top_level

    alias_top_level(__name__)
else:
    from . import nn, parallel

    __all__ = ["nn", "parallel"]
