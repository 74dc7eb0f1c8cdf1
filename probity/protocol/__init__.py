"""The server <-> engine pipe, the one thing both sides share (docs/protocol.md is its prose):
`frames` (kinds, bounds, encoding, checked readers), `submit` (SUBMIT's fields, bounds and the
`Sampling` type), `schema` (the payload checks) and `strict_json` (the JSON reader for every
peer's bytes). `from probity import protocol as P` reaches all of them."""
from .schema import *  # noqa: F401,F403
from .submit import *  # noqa: F401,F403
from .frames import *  # noqa: F401,F403
