"""Chat templates, which are user data, rendered so that none can take the machine: a bounded Jinja sandbox
(`sandbox`) run in a child process under hard memory and CPU limits (`render`).

May import: nothing of posfreq beyond this package (jinja2 and the standard library only).
"""
