"""The sender process: it writes the streamed responses' bytes into their clients' sockets.

Every socket send releases and retakes the interpreter's lock, and with many streams a thread
sending them keeps taking that lock from the engine's thread. So the server (streams.py) hands
each stream's socket to this process (SCM_RIGHTS) when the stream starts, and then, per batch of
outputs, one message of every stream's encoded bytes; the process sends what each socket takes
without blocking (a slow reader keeps its bytes here and holds up no one else) and reports a
stream whose bytes are all sent after its end, or whose client is gone. It runs as a script on
the standard library alone (no device, no model): `python sender.py FD`, FD its end of a
SOCK_SEQPACKET pair.

Messages to it: ATTACH id (the socket rides along), DATA (records: id, whether the stream ends
after these bytes, the bytes), FORGET id (the server has given the stream up). From it: SENT id
(all sent, the stream ended; its socket closed here) and GONE id (the client left).
"""
import select
import socket
import struct
import sys

ATTACH, DATA, FORGET, SENT, GONE = b"A", b"D", b"F", b"S", b"G"
ID = struct.Struct("<I")
RECORD = struct.Struct("<IBI")          # stream id, ends, length of the bytes that follow
MAX_MESSAGE = 1 << 16                   # fits a SOCK_SEQPACKET pair's default buffer


def records(parts):
    """DATA messages of (id, bytes, ends) parts, each at most MAX_MESSAGE bytes: a long part is
    cut into records of the same id, the last one carrying `ends`."""
    messages, message = [], bytearray(DATA)
    for sid, data, ends in parts:
        view = memoryview(data)
        while True:
            if len(message) + RECORD.size >= MAX_MESSAGE:
                messages.append(bytes(message))
                message = bytearray(DATA)
            piece = view[:MAX_MESSAGE - len(message) - RECORD.size]
            view = view[len(piece):]
            last = not view
            message += RECORD.pack(sid, ends and last, len(piece))
            message += piece
            if last:
                break
    if len(message) > 1:
        messages.append(bytes(message))
    return messages


class Client:
    def __init__(self, sock):
        self.sock, self.out, self.ends = sock, bytearray(), False


def serve(control):
    clients = {}            # stream id -> Client
    blocked = set()         # ids whose sockets took not all their bytes

    def report(kind, sid):
        clients.pop(sid).sock.close()
        blocked.discard(sid)
        control.send(kind + ID.pack(sid))

    def flush(sid):
        client = clients[sid]
        try:
            while client.out:
                del client.out[:client.sock.send(client.out)]
        except BlockingIOError:
            blocked.add(sid)
            return
        except OSError:
            report(GONE, sid)
            return
        blocked.discard(sid)
        if client.ends:
            report(SENT, sid)

    while True:
        waiting = {clients[sid].sock: sid for sid in blocked}
        readable, writable, _ = select.select([control], list(waiting), [])
        touched = {waiting[sock] for sock in writable}
        if readable:
            control.setblocking(False)
            try:
                while True:
                    message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 1)
                    if not message:
                        return          # the server has gone
                    kind = message[:1]
                    if kind == ATTACH:
                        sid, = ID.unpack_from(message, 1)
                        sock = socket.socket(fileno=fds[0])
                        sock.setblocking(False)
                        clients[sid] = Client(sock)
                    elif kind == FORGET:
                        sid, = ID.unpack_from(message, 1)
                        if sid in clients:
                            clients.pop(sid).sock.close()
                            blocked.discard(sid)
                            touched.discard(sid)
                    else:
                        at = 1
                        while at < len(message):
                            sid, ends, n = RECORD.unpack_from(message, at)
                            at += RECORD.size
                            client = clients.get(sid)
                            if client is not None:
                                client.out += message[at:at + n]
                                client.ends |= bool(ends)
                                touched.add(sid)
                            at += n
            except BlockingIOError:
                pass
            finally:
                control.setblocking(True)
        for sid in touched:
            if sid in clients:
                flush(sid)


if __name__ == "__main__":
    try:
        serve(socket.socket(fileno=int(sys.argv[1])))
    except (KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        pass
