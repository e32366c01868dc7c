"""The peers for bench/ingest.py: python-hl7's own asyncio MLLP server (`hl7.mllp.start_hl7_server`).

    --mode db        one INSERT + COMMIT per message into PostgreSQL, then the ACK (the peer)
    --mode parse     python-hl7 parse and ACK only, no database
    --mode ceiling   frame and answer a fixed ACK: no parsing, no database (the ceiling)
"""
from __future__ import annotations

import argparse
import asyncio
import uuid

import hl7
from hl7.mllp import start_hl7_server

# The peer's own table, as in ../shared/peers/ack_after_insert_server.py (Stageline's staged tables
# keep bodies apart since store v4, which no naive server would do).
SCHEMA = ("CREATE TABLE IF NOT EXISTS peer_inbound_stage (id bigserial PRIMARY KEY, message_id text NOT NULL, "
          "control_id text, channel text NOT NULL, payload text NOT NULL, created timestamptz DEFAULT now())")
INSERT = ("INSERT INTO peer_inbound_stage (message_id, control_id, channel, payload) "
          "VALUES (%s, %s, 'peer', %s)")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=["db", "parse", "ceiling"], required=True)
    ap.add_argument("--dsn", default="")
    args = ap.parse_args()
    if args.mode == "db":
        import psycopg

        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as c:
            await c.execute(SCHEMA)

    async def handle(reader, writer) -> None:
        conn = None
        if args.mode == "db":
            import psycopg

            conn = await psycopg.AsyncConnection.connect(args.dsn)
        try:
            while not writer.is_closing():
                message = await reader.readmessage()
                if conn is not None:
                    await conn.execute(INSERT, (uuid.uuid4().hex, str(message.segment("MSH")[10]), str(message)))
                    await conn.commit()
                writer.writemessage(message.create_ack())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
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

    if args.mode == "ceiling":
        server = await asyncio.start_server(frame_only, "127.0.0.1", args.port, limit=16 * 1024 * 1024)
    else:
        server = await start_hl7_server(handle, "127.0.0.1", args.port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
