"""The peers for bench/ingest.py: python-hl7's own asyncio MLLP server (`hl7.mllp.start_hl7_server`).

--mode db        python-hl7 parse, one INSERT + COMMIT per message into PostgreSQL, then its ACK
--mode strong    the strong naive durable peer (../shared/peers/ack_after_insert_server.py):
                 framing only (readblock), one INSERT + COMMIT, then an ACK built from MSH-10
--mode parse     python-hl7 parse and ACK only, no database
--mode ack       framing only and an AA for each message's MSH-10, no database (a fast receiver
                 for bench/pipeline.py's MLLP delivery)
--mode ceiling   frame and answer a fixed ACK: no parsing, no database (the ceiling)
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hl7.mllp import start_hl7_server

TABLE = (
    "CREATE TABLE IF NOT EXISTS inbound_stage (id bigserial PRIMARY KEY, channel text, control_id text, "
    "payload text, created timestamptz DEFAULT now())"
)
INSERT = "INSERT INTO inbound_stage (channel, control_id, payload) VALUES ('in', %s, %s)"


def raw_ack(block: bytes) -> bytes:
    """An AA for `block` from its MSH by string operations (no parse), as the strong peer does."""
    msh = block.split(b"\r", 1)[0]
    f = msh.split(msh[3:4])
    ctl = f[9] if len(f) > 9 else b""
    return (
        b"MSH|^~\\&|ENGINE|SPIKE|"
        + f[2]
        + b"|"
        + f[3]
        + b"|20240101000000||ACK|"
        + ctl
        + b"|P|"
        + (f[11] if len(f) > 11 else b"2.5")
        + b"\rMSA|AA|"
        + ctl
        + b"\r"
    )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=["db", "strong", "parse", "ack", "ceiling"], required=True)
    ap.add_argument("--dsn", default="")
    args = ap.parse_args()

    async def handle(reader, writer) -> None:
        conn = None
        try:
            if args.mode in ("db", "strong"):
                import psycopg

                conn = await psycopg.AsyncConnection.connect(args.dsn)
            while not writer.is_closing():
                if args.mode in ("strong", "ack"):
                    block = await reader.readblock()
                    if conn is not None:
                        ctl = block.split(b"\r", 1)[0].split(b"|")[9].decode()
                        await conn.execute(INSERT, (ctl, block.decode("utf-8", "replace")))
                        await conn.commit()  # durable before the ACK
                    writer.writeblock(raw_ack(block))
                    await writer.drain()
                    continue
                message = await reader.readmessage()
                if conn is not None:
                    await conn.execute(INSERT, (str(message.segment("MSH")[10]), str(message)))
                    await conn.commit()
                writer.writemessage(message.create_ack())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:  # say so, and close: a sender must not wait for an ACK that never comes
            print(f"peer connection failed: {exc!r}", file=sys.stderr, flush=True)
        finally:
            if conn is not None:
                await conn.close()
            writer.close()

    ack = b"\x0bMSH|^~\\&|STAGELINE|HOSP|S|F|20261122101500||ACK^A01^ACK|1|P|2.5.1\rMSA|AA|1\r\x1c\r"

    async def frame_only(reader, writer) -> None:
        try:
            while True:
                await reader.readuntil(b"\x1c\r")
                writer.write(ack)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    if args.mode in ("db", "strong"):
        import psycopg

        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as c:
            await c.execute(TABLE)
    if args.mode == "ceiling":
        server = await asyncio.start_server(frame_only, "127.0.0.1", args.port, limit=16 * 1024 * 1024)
    else:
        server = await start_hl7_server(handle, "127.0.0.1", args.port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
