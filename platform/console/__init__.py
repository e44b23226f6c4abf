"""The web console at /console: server-rendered pages for tenants and admins over the same services as the API.

Signing in exchanges an API key (or the admin token) for a server-side session (sessions.py); every page checks
it, every form that changes something carries the session's CSRF token (security.py), and every response carries
the console's Content-Security-Policy. Pages are Jinja templates (templates/console/); the few live parts (upload
progress, the streamed playground, copy buttons) are plain JavaScript files under static/. Why it is built this
way: docs/decisions/0029-console.md.
"""
