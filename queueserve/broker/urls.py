"""Redis URLs as they may be shown: in logs, exception messages and CLI output."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

HIDDEN = "***"
_SECRET_PARAMS = {"password", "sentinel_password"}


def redact_url(url: str) -> str:
    """``url`` without its password: ``redis://app:s3cret@db:6379/0`` -> ``redis://app:***@db:6379/0``.

    A lone ``redis://token@host`` hides the whole user part (it is often a password), and
    ``?password=`` query parameters are hidden too. A URL that cannot be parsed is not shown.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a Redis URL that could not be parsed>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{HIDDEN}@{host}" if colon else f"{HIDDEN}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            query = urlencode(
                [(k, HIDDEN if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*"
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret
    # Joined by hand: urlunsplit would rewrite unix:///path as unix:/path.
    shown = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    return shown + (f"#{parts.fragment}" if parts.fragment else "")
