#!/usr/bin/env bash
# Make sure the services lastcall's tests and demo need are up: RabbitMQ (with the
# management and Prometheus plugins) and PostgreSQL (database `test`). Starts or repairs
# them where it can; says exactly what to do where it cannot. Idempotent.
set -euo pipefail

log() { echo "[services] $*" >&2; }

ensure_rabbitmq() {
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    local sudo=()
    if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then sudo=(sudo -n); fi
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ ${#sudo[@]} -gt 0 ]; }; then
      log "installing rabbitmq-server (apt-get)"
      "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y rabbitmq-server >&2
    else
      log "RabbitMQ is not installed. Install it (Debian: sudo apt-get install rabbitmq-server) or set LASTCALL_AMQP_URL to a running broker."
      return 1
    fi
  fi
  if ! rabbitmqctl -q status >/dev/null 2>&1; then
    log "starting RabbitMQ (rabbitmq-server -detached)"
    rabbitmq-server -detached >/dev/null 2>&1 || true
  fi
  for _ in $(seq 1 90); do
    rabbitmqctl -q await_startup >/dev/null 2>&1 && break
    sleep 1
  done
  rabbitmqctl -q await_startup >/dev/null 2>&1 || { log "RabbitMQ did not start; see rabbitmqctl status"; return 1; }
  rabbitmq-plugins -q enable rabbitmq_management rabbitmq_prometheus >/dev/null 2>&1 || log "warning: could not enable the management/prometheus plugins"
  # The AMQP listener may come up a moment after the node.
  for _ in $(seq 1 30); do
    (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && { log "RabbitMQ is up on 127.0.0.1:5672"; return 0; }
    sleep 1
  done
  log "RabbitMQ is running but not listening on 127.0.0.1:5672"
  return 1
}

ensure_postgres() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1 && ! command -v psql >/dev/null 2>&1; then
    log "PostgreSQL is not installed (Debian: sudo apt-get install postgresql); the PostgreSQL tests need it"
    return 1
  fi
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    log "starting PostgreSQL"
    for v in $(ls /etc/postgresql 2>/dev/null); do
      pg_ctlcluster --skip-systemctl-redirect "$v" main start >/dev/null 2>&1 || true
    done
  fi
  for _ in $(seq 1 60); do
    pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && break
    sleep 1
  done
  pg_isready -q -h 127.0.0.1 -p 5432 || { log "PostgreSQL did not come up on 127.0.0.1:5432"; return 1; }
  if ! psql -h 127.0.0.1 -U postgres -d test -qtAc 'select 1' >/dev/null 2>&1; then
    psql -h 127.0.0.1 -U postgres -d postgres -qc 'CREATE DATABASE test' >/dev/null 2>&1 || true
  fi
  psql -h 127.0.0.1 -U postgres -d test -qtAc 'select 1' >/dev/null || { log "cannot connect to postgres://postgres@127.0.0.1:5432/test"; return 1; }
  log "PostgreSQL is up on 127.0.0.1:5432 (database test)"
}

case "${1:-all}" in
  rabbitmq) ensure_rabbitmq ;;
  postgres) ensure_postgres ;;
  all) ensure_rabbitmq; ensure_postgres ;;
  *) echo "usage: $0 [all|rabbitmq|postgres]" >&2; exit 2 ;;
esac
