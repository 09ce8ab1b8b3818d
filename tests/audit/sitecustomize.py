"""Records what a Python process does with the network and which modules it holds from beyond
the standard library, for the no-network tests (tests/offline.py): one line per event, appended
to the file that POOT_TEST_AUDIT names. On sys.path through PYTHONPATH only; inert without it.

The socket events are the interpreter's own audit events (PEP 578): every bind, connect, send to
an address and name lookup of the socket module. The modules are those in sys.modules at exit
but not at startup (the interpreter's site setup is not the program's); an import that was only
attempted, as the standard library's own fallbacks do, is not one.
"""
import atexit
import os
import sys

LOG = os.environ.get("POOT_TEST_AUDIT")
ON_A_SOCKET = {"socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg"}
LOOKUPS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
           "socket.getnameinfo"}


def top_level(modules):
    return {name.partition(".")[0] for name in list(modules)}


AT_STARTUP = top_level(sys.modules)


def write(line):
    with open(LOG, "a") as log:
        log.write(line + "\n")


def record(event, args):
    if event in ON_A_SOCKET:
        write(f"{event} {args[1]!r}")           # args[0] is the socket itself
    elif event in LOOKUPS:
        write(f"{event} {args!r}")


def record_modules():
    names = top_level(sys.modules) - AT_STARTUP - set(sys.stdlib_module_names)
    for name in sorted(names - {"__main__", "sitecustomize"}):
        write(f"import {name}")


if LOG:
    sys.addaudithook(record)
    atexit.register(record_modules)
