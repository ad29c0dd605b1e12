"""The HTTP face of the teacher service: thin routers over the services, the request
dependencies, the ASGI middleware and the browser pages (``ui``)."""
