# The API and the control worker (docker-compose.yml: migrate, api, worker-control).
# No ML stack: the package without its `worker` extra, so the image stays small and the API
# starts fast. GPU workers use Dockerfile.gpu.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRAINYARD_HOME=/var/lib/trainyard \
    TRAINYARD_ARTIFACTS_DIR=/var/lib/trainyard/artifacts

# The same uid as in Dockerfile.gpu: both write the shared artifacts volume.
RUN groupadd --system --gid 10001 trainyard \
    && useradd --system --uid 10001 --gid trainyard --home-dir /var/lib/trainyard \
        --shell /usr/sbin/nologin trainyard \
    && mkdir -p /var/lib/trainyard/artifacts \
    && chown -R trainyard:trainyard /var/lib/trainyard

WORKDIR /opt/trainyard

# The dependencies first, in a layer of their own that a code change does not rebuild, at
# the versions CI tests (constraints.txt).
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
    && pip install -c constraints.txt -r requirements.txt \
    && rm requirements.txt

COPY README.md alembic.ini ./
COPY migrations ./migrations
COPY configs ./configs
COPY workers ./workers
COPY app ./app
# Editable, so the installed package runs from /opt/trainyard: `trainyard db upgrade` finds
# alembic.ini and migrations/ beside app/, and the API its static files.
RUN pip install --no-deps -e .

USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["trainyard"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
