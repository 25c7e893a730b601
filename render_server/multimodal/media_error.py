"""The one error a bad media input raises, fetching or decoding."""

from __future__ import annotations


class MediaError(ValueError):
    """A media input that cannot be used; the message says what was wrong with it.

    The API layer turns it into a 400 that names the content part, so the message is for
    the client: it names the URL's problem or the image's, never an internal detail.
    """
