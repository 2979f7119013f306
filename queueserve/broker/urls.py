"""Redis URLs as they may be shown: in logs, exception messages and CLI output."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

HIDDEN = "***"
_SECRET_PARAMS = {"password", "sentinel_password"}


def redact_url(url: str) -> str:
    """``url`` without its password: ``redis://app:s3cret@db:6379/0`` -> ``redis://app:***@db:6379/0``.

    A lone ``redis://token@host`` hides the whole user part (it is often a password), and
    ``?password=`` query parameters are hidden too. A password holding '/', '?' or '#' as it
    is (``has_unencoded_userinfo``) is hidden with everything up to its '@'. A URL that cannot
    be parsed is not shown.
    """
    if has_unencoded_userinfo(url):
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{HIDDEN}@{rest.rpartition('@')[2]}"
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


def has_unencoded_userinfo(url: str) -> bool:
    """Whether ``url``'s user info (``user:password@``) holds '/', '?' or '#' that are not
    percent-encoded: the address then ends at that character, and the rest of the password
    becomes the path, query or fragment, which a parser shows as such (in logs, in errors).

    Told by an '@' after the address ends when the address is no host[:port] list (``u:pa``
    has no port), or the '@' is in the path (a database number, a socket path after a user
    info, or a sentinel's service name never holds one), in the fragment, or in a query
    before any '=' (``?password=p@ss`` is a query parameter, not this).
    """
    scheme, sep, rest = url.partition("://")
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    netloc, after = rest[:cut], rest[cut:]
    if not sep or "@" in netloc or "@" not in after:
        return False
    if scheme.lower() == "unix" and not netloc:
        return False  # unix:///run/user@1/redis.sock: a path, no user info
    path_end = min((i for i in map(after.find, "?#") if i >= 0), default=len(after))
    path, tail = after[:path_end], after[path_end:]
    query, _, fragment = tail.partition("#")
    return (
        not _is_hosts(netloc)
        or "@" in path
        or "@" in fragment
        or ("@" in query and "=" not in query.partition("@")[0])
    )


def _is_hosts(netloc: str) -> bool:
    """Whether ``netloc`` reads as host[:port][,host[:port]...] (a bracketed IPv6 host as
    it is)."""
    for part in netloc.split(","):
        host, colon, port = part.rpartition(":") if not part.endswith("]") else (part, "", "")
        if colon and (not host or not port.isdigit()):
            return False
    return True
