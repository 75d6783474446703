"""The built-in sharding rules, one module per op family (``pointwise``, ``matrix``, ...);
``builtin.py`` fills the dispatcher's rule table (``arrays/rule_table.py``) with them when
``shardfn`` is imported."""

from .custom import register_sharding as register_sharding
