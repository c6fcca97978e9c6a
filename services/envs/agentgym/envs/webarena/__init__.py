"""Web navigation in a real browser: MiniWoB++ tasks offline, real WebArena sites by URL.

Playwright (async) drives Debian's Chromium; observations are WebArena-style accessibility-tree
lines, actions follow WebArena's grammar (`click [id]`, `type [id] [text] [0|1]`, ...).
"""
