"""The config: its typed schema (schema.py) and its loading and validation (validate.py), handed on here under
one name. Everything downstream receives a `RootConfig` object from `load`, never a DictConfig.
"""

from orchestrator.config.schema import *  # noqa: F403
from orchestrator.config.schema import __all__ as _schema
from orchestrator.config.validate import *  # noqa: F403
from orchestrator.config.validate import __all__ as _validate

__all__ = [*_schema, *_validate]
