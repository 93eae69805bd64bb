#!/usr/bin/env bash
# Docker for reservoir's container tests and deployments, on a Debian machine with no
# registry but Debian's and PyPI: this script owns installing the engine, starting it, and
# building the three images from Debian packages and wheels, each only when missing.
#
#   deploy/ci/docker.sh [all]          everything below, in order (what .ci/run calls)
#   deploy/ci/docker.sh packages       apt-get install docker.io debootstrap docker-compose
#                                      (only what is missing)
#   deploy/ci/docker.sh engine         start dockerd when no engine answers
#   deploy/ci/docker.sh rabbitmq-image reservoir/rabbitmq:<RabbitMQ version>
#   deploy/ci/docker.sh python-image   reservoir/python:<Python version> (Debian, python3)
#   deploy/ci/docker.sh reservoir-image  reservoir:<version>-<source hash>, also tagged
#                                      reservoir:latest; prints the tag on stdout
#   deploy/ci/docker.sh clean RUN      remove the containers, networks and volumes labelled
#                                      org.reservoir.test-run=RUN (a test run's leftovers)
#   deploy/ci/docker.sh stop-engine    stop the dockerd whose pid is in
#                                      $RESERVOIR_DOCKERD_STARTED, if this script started it
#
# Progress goes to stderr; stdout carries only what a command prints for a caller (the
# reservoir image's tag). Images are cached: a later run builds only what is missing, and
# the reservoir image only when the project's sources changed (its tag holds their hash).
#
# Environment:
#   RESERVOIR_DOCKERD_STARTED  a file: when this script starts dockerd it writes the pid
#                              there, so the caller (.ci/run) can stop it at the end
#   RESERVOIR_DEBIAN_SUITE     the Debian release the images are made of (bookworm: its
#                              python3 is 3.11 and its rabbitmq-server 3.10)
#   RESERVOIR_WHEEL_CACHE      where the dependencies' wheels are kept between builds
#                              (default ~/.cache/reservoir/wheels)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
suite="${RESERVOIR_DEBIAN_SUITE:-bookworm}"
wheel_cache="${RESERVOIR_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/reservoir/wheels}"
label_image="org.reservoir.image"
label_run="org.reservoir.test-run"
# what the reservoir wheel is built from
source_files=(reservoir pyproject.toml README.md)

say() { echo "docker.sh: $*" >&2; }

# Scratch directories (root filesystems, build contexts) are removed on exit, whatever
# happened: an interrupted build leaves nothing behind in /var/tmp.
scratch=()
remove_scratch() {
    local dir mount
    for dir in "${scratch[@]}"; do
        # an interrupted debootstrap leaves /proc and /sys (maybe /dev) mounted inside its
        # target: unmount them first, and never descend into another file system
        awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r |
            while read -r mount; do
                umount -l "$mount" 2>/dev/null || true
            done
        rm -rf --one-file-system "$dir"
    done
}
trap remove_scratch EXIT

# -- packages and the engine -----------------------------------------------------------------

ensure_packages() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
    if [ "${#missing[@]}" -eq 0 ]; then
        return
    fi
    say "installing ${missing[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # another apt on the machine (an engineer's, unattended-upgrades) may hold the lock
    apt-get install -y -qq -o DPkg::Lock::Timeout=300 "${missing[@]}" >/dev/null
}

engine_answers() {
    docker info >/dev/null 2>&1
}

ensure_engine() {
    if engine_answers; then
        say "a Docker engine answers"
        return
    fi
    local log=/var/log/reservoir-dockerd.log
    say "starting dockerd (log: $log)"
    # --ip: a port published without an address is bound to loopback, never to every
    # interface (the tests and the compose file name 127.0.0.1 themselves too).
    setsid dockerd --ip 127.0.0.1 >>"$log" 2>&1 </dev/null &
    local pid=$!
    if [ -n "${RESERVOIR_DOCKERD_STARTED:-}" ]; then
        echo "$pid" >"$RESERVOIR_DOCKERD_STARTED"
    fi
    for _ in $(seq 1 60); do
        if engine_answers; then
            say "dockerd is up (pid $pid)"
            return
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            say "dockerd exited; the end of its log:"
            tail -n 20 "$log" >&2
            exit 1
        fi
        sleep 1
    done
    say "dockerd did not answer within 60 s; the end of its log:"
    tail -n 20 "$log" >&2
    exit 1
}

stop_engine() {
    local file="${RESERVOIR_DOCKERD_STARTED:-}"
    if [ -z "$file" ] || [ ! -s "$file" ]; then
        return
    fi
    local pid
    pid="$(cat "$file")"
    # only the dockerd this script started: a pid can be reused by then
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "dockerd" ]; then
        say "stopping the dockerd this run started (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 1 30); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
    fi
    : >"$file"
}

# -- the Debian root filesystems ---------------------------------------------------------------

# The Debian archive this machine's apt uses (never a constant: the machine may have a
# mirror of its own): the first "deb" source for the main archive (not -security), in
# deb822 (.sources) or one-line (.list) form.
apt_mirror() {
    python3 - /etc/apt/sources.list.d/* /etc/apt/sources.list <<'PY'
import pathlib, re, sys

def entries(path):
    text = path.read_text(errors="replace")
    if path.suffix == ".sources":
        for stanza in re.split(r"\n\s*\n", text):
            fields = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.split()
            if fields.get("enabled", ["yes"])[0].lower() == "no":
                continue
            if "deb" in fields.get("types", []):
                for uri in fields.get("uris", []):
                    yield uri, fields.get("suites", [])
    elif path.suffix == ".list" or path.name == "sources.list":
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if len(words) >= 3 and words[0] == "deb":
                yield words[1], [words[2]]

for name in sys.argv[1:]:
    path = pathlib.Path(name)
    if not path.is_file():
        continue
    for uri, suites in entries(path):
        if any(not re.search(r"-(security|updates|backports)$", s) for s in suites) and uri.rstrip("/").endswith("/debian"):
            print(uri)
            raise SystemExit(0)
raise SystemExit("no Debian archive found in /etc/apt/sources.list.d or /etc/apt/sources.list")
PY
}

# debootstrap $suite into the empty directory ROOTFS, with the packages after it.
make_rootfs() {
    local rootfs="$1" mirror includes
    shift
    mirror="$(apt_mirror)"
    includes="$(IFS=,; echo "$*")"
    say "debootstrap $suite with $* from $mirror"
    if ! debootstrap --variant=minbase --include="$includes" "$suite" "$rootfs" "$mirror" \
        >"$rootfs.log" 2>&1; then
        say "debootstrap failed; the end of its log:"
        tail -n 20 "$rootfs.log" >&2
        rm -f "$rootfs.log"
        exit 1
    fi
    rm -f "$rootfs.log"
    # what apt downloaded is not needed in an image
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
}

package_version() { # ROOTFS PACKAGE: the upstream version, e.g. 3.10.8 of 3.10.8-1.1
    dpkg-query --admindir="$1/var/lib/dpkg" -W -f='${Version}' "$2" |
        sed -E 's/^[0-9]+://; s/-[^-]*$//'
}

image_with_label() { # VALUE: the first image labelled org.reservoir.image=VALUE
    docker images --filter "label=$label_image=$1" --format '{{.Repository}}:{{.Tag}}' |
        { grep -v '<none>' || true; } | head -n 1
}

# -- the images ---------------------------------------------------------------------------

rabbitmq_image() {
    local existing
    existing="$(image_with_label rabbitmq)"
    if [ -n "$existing" ]; then
        say "RabbitMQ image: $existing (cached)"
        return
    fi
    local started=$SECONDS rootfs version tag
    rootfs="$(mktemp -d /var/tmp/reservoir-rootfs.XXXXXX)"
    scratch+=("$rootfs" "$rootfs.log")
    make_rootfs "$rootfs" rabbitmq-server
    version="$(package_version "$rootfs" rabbitmq-server)"
    tag="reservoir/rabbitmq:$version"
    # guest may log in through a published port (the container's loopback is not the
    # client's); the test image is reached on 127.0.0.1 of the host only
    printf 'loopback_users = none\n' >"$rootfs/etc/rabbitmq/rabbitmq.conf"
    tar --numeric-owner -C "$rootfs" -c . | docker import \
        --change 'USER rabbitmq' \
        --change 'WORKDIR /var/lib/rabbitmq' \
        --change 'ENV HOME=/var/lib/rabbitmq RABBITMQ_LOGS=- PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'EXPOSE 5672' \
        --change "LABEL $label_image=rabbitmq org.reservoir.rabbitmq-version=$version" \
        --change 'CMD ["/usr/lib/rabbitmq/bin/rabbitmq-server"]' \
        - "$tag" >/dev/null
    say "RabbitMQ image: $tag built in $((SECONDS - started)) s"
}

# Sets python_tag (no command substitution: the scratch list must stay in this shell).
python_image() {
    python_tag="$(image_with_label python)"
    if [ -n "$python_tag" ]; then
        say "Python image: $python_tag (cached)"
        return
    fi
    local started=$SECONDS rootfs version
    rootfs="$(mktemp -d /var/tmp/reservoir-rootfs.XXXXXX)"
    scratch+=("$rootfs" "$rootfs.log")
    # python3-venv brings ensurepip, so the image can make a venv without pip from apt
    make_rootfs "$rootfs" python3 python3-venv
    version="$(package_version "$rootfs" python3)"
    python_tag="reservoir/python:$version"
    tar --numeric-owner -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        --change "LABEL $label_image=python org.reservoir.python-version=$version" \
        --change 'CMD ["python3"]' \
        - "$python_tag" >/dev/null
    say "Python image: $python_tag built in $((SECONDS - started)) s"
}

# The hash of what goes into the reservoir wheel, from the work tree (uncommitted edits
# included), so a cached image is reused exactly while the code it holds is the same.
source_hash() {
    (
        cd "$root"
        git ls-files -z -- "${source_files[@]}" |
            xargs -0 sha256sum | sha256sum | cut -c1-12
    )
}

# The dependencies' wheels (and the api extra's) for the image's Python, downloaded once
# per set of requirements and kept in $wheel_cache; sets deps_dir.
dependency_wheels() {
    local requirements key dir arch
    requirements="$(python3 - "$root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for requirement in sorted(set(project["dependencies"] + project["optional-dependencies"]["api"])):
    print(requirement)
PY
)"
    arch="$(uname -m)"
    key="$(printf '%s\n%s cp311 %s\n' "$requirements" "$suite" "$arch" | sha256sum | cut -c1-12)"
    dir="$wheel_cache/$key"
    if [ ! -f "$dir/requirements.txt" ]; then
        say "downloading the dependencies' wheels for CPython 3.11 on $arch into $dir"
        rm -rf "$dir.partial"
        mkdir -p "$dir.partial"
        printf '%s\n' "$requirements" >"$dir.partial/requirements.in"
        # For the image's interpreter, not this machine's: binary wheels only, for glibc
        # 2.36 (bookworm) and older. pip takes each platform tag literally, so every
        # manylinux tag up to 2.36 is named, and the legacy aliases.
        local platforms=(--platform any --platform "manylinux1_$arch"
            --platform "manylinux2010_$arch" --platform "manylinux2014_$arch") glibc
        for glibc in $(seq 5 36); do
            platforms+=(--platform "manylinux_2_${glibc}_$arch")
        done
        python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
            --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none \
            "${platforms[@]}" -d "$dir.partial" -r "$dir.partial/requirements.in" 2>&1 |
            { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
        mv "$dir.partial/requirements.in" "$dir.partial/requirements.txt"
        mv "$dir.partial" "$dir"
    fi
    deps_dir="$dir"
}

reservoir_image() {
    local version hash tag
    version="$(sed -nE 's/^version = "([^"]+)"$/\1/p' "$root/pyproject.toml" | head -n 1)"
    hash="$(source_hash)"
    tag="reservoir:$version-$hash"
    if docker image inspect "$tag" >/dev/null 2>&1; then
        say "reservoir image: $tag (cached)"
        docker tag "$tag" reservoir:latest
        echo "$tag"
        return
    fi
    local started=$SECONDS context
    python_image
    dependency_wheels
    context="$(mktemp -d /var/tmp/reservoir-image.XXXXXX)"
    scratch+=("$context" "$context.log")
    mkdir -p "$context/deps" "$context/project"
    cp "$deps_dir"/* "$context/deps/"
    # the wheel is built from a copy of exactly the hashed files: building in the work
    # tree would leave build/ there, and setuptools would reuse its stale files
    mkdir -p "$context/source"
    (cd "$root" && git ls-files -z -- "${source_files[@]}" | xargs -0 cp --parents -t "$context/source")
    python3 -m pip wheel --quiet --disable-pip-version-check --no-deps \
        -w "$context/project" "$context/source" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    rm -rf "$context/source"
    cp "$here/../docker/Dockerfile" "$context/Dockerfile"
    # The classic builder: BuildKit would want a frontend image, and nothing can be pulled
    # (its deprecation notice is all it says on success: shown only on a failure).
    if ! DOCKER_BUILDKIT=0 docker build --quiet \
        --build-arg "BASE=$python_tag" \
        --label "$label_image=reservoir" --label "org.reservoir.source=$hash" \
        -t "$tag" "$context" >/dev/null 2>"$context.log"; then
        cat "$context.log" >&2
        rm -f "$context.log"
        exit 1
    fi
    rm -f "$context.log"
    docker tag "$tag" reservoir:latest
    # one cached reservoir image is enough: older builds of other sources are removed
    local old
    for old in $(docker images --filter "label=$label_image=reservoir" \
        --format '{{.Repository}}:{{.Tag}}' | grep -v -e '<none>' -e ':latest$'); do
        [ "$old" = "$tag" ] || docker rmi "$old" >/dev/null 2>&1 || true
    done
    say "reservoir image: $tag built in $((SECONDS - started)) s"
    echo "$tag"
}

# -- a test run's leftovers ---------------------------------------------------------------------

clean_run() {
    local run="$1" filter="label=$label_run=$1" ids
    engine_answers || return 0
    ids="$(docker ps -aq --filter "$filter")"
    if [ -n "$ids" ]; then
        say "removing the containers run $run left: $(echo "$ids" | wc -l)"
        # shellcheck disable=SC2086
        docker rm -f -v $ids >/dev/null
    fi
    ids="$(docker network ls -q --filter "$filter")"
    # shellcheck disable=SC2086
    [ -z "$ids" ] || docker network rm $ids >/dev/null
    ids="$(docker volume ls -q --filter "$filter")"
    # shellcheck disable=SC2086
    [ -z "$ids" ] || docker volume rm -f $ids >/dev/null
}

case "${1:-all}" in
all)
    ensure_packages
    ensure_engine
    rabbitmq_image
    reservoir_image >/dev/null
    ;;
packages) ensure_packages ;;
engine) ensure_engine ;;
rabbitmq-image) rabbitmq_image ;;
python-image)
    python_image
    echo "$python_tag"
    ;;
reservoir-image) reservoir_image ;;
clean) clean_run "${2:?usage: docker.sh clean RUN}" ;;
stop-engine) stop_engine ;;
*)
    sed -n '2,30p' "$0" >&2
    exit 2
    ;;
esac
