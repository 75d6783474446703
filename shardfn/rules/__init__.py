"""The built-in sharding rules, one module per op family (``pointwise``, ``matrix``, ...).
Importing this package fills the dispatcher's rule table (``arrays/rule_table.py``)."""

from . import builtin as builtin  # noqa: F401  (fills the rule table)
from .custom import register_sharding as register_sharding
