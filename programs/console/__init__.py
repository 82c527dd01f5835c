"""`mesh console`: the fleet as a web page, live and read-only (server.py; the page in static/)."""
