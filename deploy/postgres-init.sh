#!/usr/bin/env bash
# First-start initialisation of the compose cluster's PostgreSQL (docker-compose.yaml, service
# `postgres`): the official image runs this once, on an empty data volume, from
# /docker-entrypoint-initdb.d/. It creates two roles and two databases, each owned by its role:
#
#   stageline / stageline  the Stageline store (staged tables, leader lease, membership, audit);
#                          `stageline db migrate` creates the schema as this role
#   airflow   / airflow    Airflow's metadata DB; `airflow db migrate` creates it as this role
#
# Passwords come from the container's environment (STAGELINE_STORE_PASSWORD, AIRFLOW_DB_PASSWORD),
# never from this file. Being database owners, both roles may create tables in their database's
# `public` schema (PostgreSQL 15 no longer grants CREATE on `public` to everybody). To re-run it,
# remove the data volume (`docker compose down -v`): it is not applied to an existing database.
#
# The image executes this file when it is executable and sources it otherwise; the body runs in a
# subshell either way, so its shell options never leak into the image's entrypoint.
(
set -euo pipefail

: "${STAGELINE_STORE_PASSWORD:?STAGELINE_STORE_PASSWORD must be set for the postgres service}"
: "${AIRFLOW_DB_PASSWORD:?AIRFLOW_DB_PASSWORD must be set for the postgres service}"

# Passwords are handed over as psql variables and quoted by psql (:'name'), so any character is safe.
psql -v ON_ERROR_STOP=1 --no-psqlrc \
     --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" \
     -v stageline_password="$STAGELINE_STORE_PASSWORD" \
     -v airflow_password="$AIRFLOW_DB_PASSWORD" <<'SQL'
CREATE ROLE stageline LOGIN PASSWORD :'stageline_password';
CREATE ROLE airflow LOGIN PASSWORD :'airflow_password';
CREATE DATABASE stageline OWNER stageline ENCODING 'UTF8' TEMPLATE template0;
CREATE DATABASE airflow OWNER airflow ENCODING 'UTF8' TEMPLATE template0;
REVOKE ALL ON DATABASE stageline FROM PUBLIC;
REVOKE ALL ON DATABASE airflow FROM PUBLIC;
SQL
)
