# One image for every Stageline process of the compose cluster (docker-compose.yaml): listenerd,
# the Airflow components, the Spark Connect server and the migrate job. It mirrors
# scripts/setup.sh: Debian 12, Python 3.11, OpenJDK 17 for Spark, the JDBC drivers from Debian's
# packages (include/spark.py loads them from /usr/share/java, never from Maven), uv, and the
# locked environment with bytecode compiled.
FROM python:3.11-slim-bookworm

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv

# The slim images strip /usr/share/man; the JRE's postinst links its man pages there.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
      openjdk-17-jre-headless \
      libpostgresql-jdbc-java \
      libxerial-sqlite-jdbc-java \
      libjtds-java \
 && rm -rf /var/lib/apt/lists/* \
 && test -f /usr/share/java/postgresql.jar \
 && test -f /usr/share/java/sqlite-jdbc.jar \
 && test -f /usr/share/java/jtds.jar

# uv from PyPI, as scripts/setup.sh installs it (uv.lock was written by uv 0.13).
RUN pip install --no-cache-dir "uv>=0.13"

WORKDIR /app

# Dependencies first (their own layer: rebuilt only when the lock changes) ...
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --locked --no-dev --no-install-project

# ... then the project. Only what runs is copied (not .venv, var/, .git or tests/: the repo has no
# .dockerignore, so the host's own .venv must not reach the image).
COPY include ./include
COPY listeners ./listeners
COPY spark_jobs ./spark_jobs
COPY dags ./dags
COPY plugins ./plugins
COPY twisted ./twisted
COPY config ./config
COPY deploy ./deploy
COPY stageline.toml ./
RUN uv sync --locked --no-dev \
 && .venv/bin/python -m compileall -q include listeners spark_jobs dags plugins \
 && test -x /app/.venv/lib/python3.11/site-packages/pyspark/bin/spark-submit

# An unprivileged user for every process. It owns AIRFLOW_HOME with its logs and $STAGELINE_VAR
# with the file destinations' directory (deploy/config/destinations.toml): a named volume mounted
# there starts with this content and ownership.
RUN useradd --create-home --uid 50000 --user-group stageline \
 && mkdir -p /opt/airflow/logs /var/lib/stageline/out/archive \
 && chown -R stageline:stageline /opt/airflow /var/lib/stageline

ENV PATH=/app/.venv/bin:$PATH \
    PYTHONPATH=/app:/app/plugins \
    PYSPARK_PYTHON=/app/.venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/app/.venv/bin/python \
    AIRFLOW_HOME=/opt/airflow \
    STAGELINE_CONFIG=/app/deploy/stageline.toml \
    STAGELINE_VAR=/var/lib/stageline

USER stageline
CMD ["listenerd", "--help"]
