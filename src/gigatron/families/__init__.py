"""Model families: one small record per family (families/<name>/__init__.py) in one registry.

Adding a family is one new folder and one `register_family` line below (or a call from user
code, e.g. a test registering a toy family).
"""

from gigatron.families import bert, gpt, mamba, retro, t5
from gigatron.families.registry import ModelFamily, family_names, get_family, register_family

register_family(gpt.FAMILY)
register_family(bert.FAMILY)
register_family(mamba.FAMILY)
register_family(t5.FAMILY)
register_family(retro.FAMILY)

__all__ = ["ModelFamily", "family_names", "get_family", "register_family"]
