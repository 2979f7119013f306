"""The wire: Redis key names, entry and reply formats, codecs. No I/O; internal."""
