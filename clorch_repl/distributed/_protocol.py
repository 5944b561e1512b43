"""Old name of :mod:`.results`; kept only until ``distributed/launch.py`` imports from there (then delete this file)."""
from ..atomic import write_json_atomic  # noqa: F401
from .results import RankResult, encode_value, read_result, write_result  # noqa: F401
