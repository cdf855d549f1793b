"""attnkit attention inside models of other libraries (``attnkit.integrations.transformers``).

Each integration imports its library only when used; attnkit itself does not depend on them.
"""

__all__: list[str] = []
