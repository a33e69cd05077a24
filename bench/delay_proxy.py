#!/usr/bin/env python3
"""TCP proxy on 127.0.0.1 that delays every byte by a fixed time in each direction.

Usage: delay_proxy.py LISTEN_PORT UPSTREAM_PORT DELAY_MS

Used by bench/run.sh (LATENCY_BENCH) to put a network round trip of 2 x DELAY_MS between
pgapply and the target server. Each direction of each connection has a reader that stamps every
chunk it receives with "send at = arrival + delay" and queues it, and a writer that forwards the
chunks in order, each no earlier than its stamp. The reader never waits for the writer (up to a
bounded backlog), so the delay adds latency without limiting throughput: chunks arriving 0.1 ms
apart leave 0.1 ms apart, DELAY_MS later. Prints "ready" on stdout once it listens.
"""

import asyncio
import socket
import sys

CHUNK = 256 * 1024
MAX_QUEUED_CHUNKS = 1024  # backpressure: the reader pauses when this many chunks wait


def nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward reader -> writer, each chunk delay seconds after it arrived, order kept."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED_CHUNKS)

    async def receive() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await queue.put((loop.time() + delay, data))
        except (ConnectionError, OSError):
            pass
        # end of this direction (not reached when cancelled)
        await queue.put((loop.time() + delay, None))

    async def send() -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    receiver = asyncio.create_task(receive())
    try:
        await send()
    finally:
        receiver.cancel()


async def handle(client_r, client_w, upstream_port: int, delay: float) -> None:
    try:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
    except OSError as e:
        print(f"delay_proxy: cannot reach 127.0.0.1:{upstream_port}: {e}", file=sys.stderr)
        client_w.close()
        return
    nodelay(client_w)
    nodelay(server_w)
    try:
        # Each direction ends on its own (half close); the connection closes when both have.
        await asyncio.gather(pump(client_r, server_w, delay), pump(server_r, client_w, delay))
    finally:
        for w in (client_w, server_w):
            w.close()


async def main() -> None:
    if len(sys.argv) != 4:
        sys.exit("usage: delay_proxy.py LISTEN_PORT UPSTREAM_PORT DELAY_MS")
    listen_port, upstream_port = int(sys.argv[1]), int(sys.argv[2])
    delay = float(sys.argv[3]) / 1000.0
    if delay < 0:
        sys.exit("delay_proxy.py: DELAY_MS must not be negative")
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, upstream_port, delay), "127.0.0.1", listen_port
    )
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
