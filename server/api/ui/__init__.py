"""The browser side of the teacher service: a status page at ``/``, a login form, and ``/docs``
(Swagger UI) served from local assets, with a declared Bearer security scheme.

* :mod:`.auth`: the login cookie (an HMAC of the API key, never the key itself);
* :mod:`.summary`: what the page shows, as plain data (jobs, caches with coverage, engine);
* :mod:`.pages`: server-rendered HTML from the Jinja templates in ``templates/`` (no JavaScript
  framework, no CDN, no build step);
* :mod:`.routes`: the routes and :func:`install`, which ``create_app`` calls.
"""

from __future__ import annotations

from .routes import install

__all__ = ["install"]
