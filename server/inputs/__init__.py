"""Input sequences: reading files and inline records, chat templates, long-input windows and
JSON id parsing, checked against the service's limits."""
