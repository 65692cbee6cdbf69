# make run     the demo server on 127.0.0.1:$(PORT); TLS_PORT=q also HTTPS on q (TLS_CERT, TLS_KEY,
#              TLS_SNI="name=cert,key;*.name2=cert2,key2"; else a self-signed certificate)
# make test    the test suite (FiveAM), ending with "N passed, M failed";
#              HUNCHENTOOT=dir runs it on the Hunchentoot in dir (for example
#              ../shared/vendor/hunchentoot-1.3.1) instead of Debian's
# make bench   the benchmark matrix, 5 rounds of 5 s a cell; make bench-quick: 1 round of 2 s, 100 connections
# make bench-connections   10,000 kept-alive connections for 60 s
# make bench-slowloris     1,000 slowloris connections for 60 s
# make bench-slow-readers  1,000 clients asking 1 MiB and reading 1 KiB a second for 60 s
# make bench-slow-bodies   1,000 clients POSTing 100 KiB at 1 KiB a second for 60 s
# make bench-tls-handshakes  1,000 silent and 1,000 half-ClientHello TLS connections for 60 s
# make bench-scale         1, 2 and one-per-core processes on one port, and behind nginx
# make bench-chunked-body  server CPU per MB of a request body sent in one-octet chunks, ours and Hunchentoot's
# make bench-sessions    a handler reading and writing a session value, sessions in the process and in PostgreSQL
# make bench-applications  the application cells alone (make bench ends with them): sessions, pages, a form, a
#                          cookie, an easy-routes route; Hunchentoot's acceptor and ours
# make bench-websockets  10,000 idle websockets, a broadcast, 1,000 echo clients for 60 s, a client that reads nothing; ours and hunchensocket
# make bench-https       GET /yo over TLS, kept alive and a new TLS connection per request, ours (one certificate,
#                        and 3 more by SNI), Hunchentoot's and nginx
# make bench-threaded-floor  the 1 ms handler cells for a bare server of 100 threads, ours and nginx: what threads can do here
# make bench-scheduling  the handler cells for ours with its workers under SCHED_OTHER and under SCHED_BATCH
# make bench-events      3,000 and 10,000 event streams, 2,000 deferred replies, a subscriber that reads nothing, two processes over PostgreSQL
# make bench-per-core   each server pinned to one processor, wrk to the other: requests/s and the server's
#                        processor time a request, ours, nginx and Woo with one worker, the threaded floor
# make bench-same-moment REV=x  ours at REV and ours as checked out, pinned to one processor and loaded at the
#                        same moment: each one's requests per processor second on the per-core table's kept-alive cells
# make bench-compression  a 10 KiB page with gzip offered, ours and nginx at level 1; ours with zstd and br
# make bench-waits       the 1 ms handler cells: ours sleeping, ours deferring its reply to its timer, nginx's echo_sleep
# make bench-access-log  GET /yo kept alive over HTTP/1.1 and h2c, ours and nginx with their access log off and to a file
# make bench-production  ours as the demo runs (access log, gzip, HTTP/2, TLS) against nginx configured the same
# make bench-memory      the demo against 1 MB replies over h2c and HTTP/1.1, then everything at once for 10 minutes
# Each target installs the Debian packages it needs first (make deps).

# make sbcl-current  builds SBCL 2.6.7 from ../shared/vendor once, outside the checkout, and prints its path;
#                    SBCL=that-path make test (or run, bench) then runs with it instead of Debian's 2.2.9

PORT ?= 4242
# The demo reads these from its environment.
export TLS_PORT TLS_CERT TLS_KEY TLS_SNI
HUNCHENTOOT ?=
REV ?= HEAD~1
# SBCL=path runs everything with another SBCL: its folder goes first on
# PATH, where each process the tests and benchmarks start finds "sbcl".
SBCL ?= sbcl
SBCL_RUN = $(SBCL) --noinform --non-interactive --disable-debugger
ifneq ($(findstring /,$(SBCL)),)
export PATH := $(abspath $(dir $(SBCL))):$(PATH)
endif
SBCL_CURRENT_PREFIX ?= $(HOME)/.cache/hunchentoot-recycling-taskmaster/sbcl-2.6.7
LIBRARY_PACKAGES = sbcl cl-hunchentoot cl-usocket cl-bordeaux-threads cl-flexi-streams \
                   cl-chunga cl-ppcre cl-plus-ssl cl-cffi cl-postmodern cl-ironclad cl-base64 \
                   zlib1g libzstd1 libbrotli1 libnghttp2-14
# The test suite's, and what the compatibility suite's libraries (and the
# Hunchentoot releases HUNCHENTOOT may name) need from Debian.
TEST_PACKAGES = cl-fiveam cl-drakma cl-plus-ssl openssl systemd postgresql nginx-light gzip brotli zstd \
                curl nghttp2-client python3-h2 \
                cl-alexandria cl-base64 cl-md5 cl-rfc2388 cl-trivial-backtrace cl-fad \
                cl-puri cl-iterate cl-split-sequence cl-trivial-utf-8 cl-global-vars \
                cl-trivial-garbage cl-trivial-features cl-who chromium \
                golang-go golang-github-fatih-color-dev golang-github-spf13-cobra-dev golang-golang-x-net-dev
# Woo, a benchmark peer built from ../shared/vendor, needs libev4 and these.
BENCH_PACKAGES = wrk nginx-light libnginx-mod-http-echo cl-aserve gnuplot-nox procps curl openssl postgresql strace linux-perf \
                 nghttp2-client \
                 libev4 cl-utilities cl-babel cl-trivial-utf-8 cl-split-sequence cl-trivial-features \
                 cl-trivial-gray-streams cl-alexandria cl-global-vars cl-trivial-garbage

.PHONY: deps test-deps bench-deps sbcl-current run test bench bench-quick bench-compare bench-connections bench-slowloris bench-slow-readers bench-slow-bodies bench-tls-handshakes bench-scale bench-chunked-body bench-sessions bench-applications bench-https bench-websockets bench-threaded-floor bench-scheduling bench-waits bench-events bench-per-core bench-same-moment bench-compression bench-http2 bench-access-log bench-production bench-memory

deps:
	@tools/install-deps.sh $(LIBRARY_PACKAGES)

test-deps: deps
	@tools/install-deps.sh $(TEST_PACKAGES)

bench-deps: deps
	@tools/install-deps.sh $(BENCH_PACKAGES)

sbcl-current:
	@tools/install-deps.sh gcc make libc6-dev
	@tools/build-sbcl.sh ../shared/vendor/sbcl-2.6.7 $(SBCL_CURRENT_PREFIX)

run: deps
	@tools/install-deps.sh openssl
	@$(SBCL_RUN) --load tools/setup.lisp \
	  --eval '(load-systems-quietly "hunchentoot-recycling-taskmaster/demo")' \
	  --eval '(hunchentoot-recycling-taskmaster-demo:main :port $(PORT))'

# The overload test holds a thousand client and a thousand server sockets.
# A suite that hangs is ended after 20 minutes (a normal run takes about 2),
# and killed 30 s later if it does not end on TERM.
test: test-deps
	ulimit -n 8192 2>/dev/null || ulimit -n $$(ulimit -Hn); \
	HUNCHENTOOT="$(HUNCHENTOOT)" timeout -k 30 1200 $(SBCL_RUN) --load test/run.lisp

bench: bench-deps
	bench/run

bench-quick: bench-deps
	bench/run --quick

bench-compare: bench-deps
	bench/run compare $(REV)

bench-connections: bench-deps
	bench/run connections

bench-slowloris: bench-deps
	bench/run slowloris

bench-slow-readers: bench-deps
	bench/run slow-readers

bench-slow-bodies: bench-deps
	bench/run slow-bodies

bench-tls-handshakes: bench-deps
	bench/run tls-handshakes

bench-scale: bench-deps
	bench/run scale

bench-chunked-body: bench-deps
	bench/run chunked-body

bench-sessions: bench-deps
	bench/run sessions

bench-applications: bench-deps
	bench/run applications

bench-https: bench-deps
	bench/run https

bench-websockets: bench-deps
	bench/run websockets

bench-threaded-floor: bench-deps
	bench/run threaded-floor

bench-scheduling: bench-deps
	bench/run scheduling

bench-waits: bench-deps
	bench/run waits

bench-events: bench-deps
	bench/run events

bench-per-core: bench-deps
	bench/run per-core

bench-same-moment: bench-deps
	bench/run same-moment $(REV)

bench-compression: bench-deps
	bench/run compression

bench-http2: bench-deps
	bench/run http2

bench-access-log: bench-deps
	bench/run access-log

bench-production: bench-deps
	bench/run production

bench-memory: bench-deps
	bench/run memory
