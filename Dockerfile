# One image for every role; compose.yaml picks the role by command.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
# CPU torch first (a bare torch requirement would pull CUDA builds).
RUN pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY bus bus
COPY vla vla
COPY services services
COPY clients clients
COPY bench bench
RUN pip install --no-cache-dir .
ENTRYPOINT ["python", "-m"]
