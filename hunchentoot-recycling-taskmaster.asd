;;;; ASDF systems: the library, its tests, its benchmarks.

(defsystem "hunchentoot-recycling-taskmaster"
  :author "The hunchentoot-recycling-taskmaster authors"
  :description "A Hunchentoot taskmaster whose pooled worker threads share an
epoll readiness set of the listening socket and every connection waiting for
bytes, with acceptors that use it by default."
  :license "BSD-2-Clause"
  :version "0.1.0"
  :depends-on ("hunchentoot" "usocket" "bordeaux-threads" "chunga" "trivial-gray-streams"
               "cl-ppcre" "flexi-streams" "cl+ssl" "cffi"
               "ironclad/digest/sha1" "cl-base64" (:feature :sbcl "sb-bsd-sockets"))
  :pathname "src/"
  :serial t
  ;; In dependency order: each file uses only what the files before it define.
  :components ((:file "package")
               (:module "sys" :serial t :components ((:file "linux")
                                                (:file "sbcl-threads")
                                                (:file "sbcl-prefetch")
                                                (:file "sbcl-epoll")
                                                (:file "sbcl-sockets")
                                                (:file "sbcl-fd-streams")
                                                (:file "sbcl-files")
                                                (:file "sbcl-clock")
                                                (:file "sbcl-heap")
                                                (:file "processors")
                                                (:file "processor-time")
                                                (:file "sbcl-deadlines")
                                                (:file "sbcl-random")
                                                (:file "sbcl-mop")
                                                (:file "openssl")
                                                (:file "zlib")
                                                (:file "zstd")
                                                (:file "brotli")
                                                (:file "nghttp2")))
               (:file "hunchentoot-internals")
               (:file "chunga-internals")
               (:file "conditions")
               (:file "cl-plus-ssl-internals")
               (:file "statistics-keys")
               (:module "sessions" :serial t :components ((:file "session-values")
                                                (:file "session-index")
                                                (:file "session-store")))
               (:file "dispatch-answers")
               (:file "easy-handler-index")
               (:file "acceptor")
               (:file "acceptor-checks")
               (:file "listening")
               (:file "server-certificates")
               (:file "websocket-resources")
               (:file "channel-bus")
               (:file "engine/protocol")
               (:module "pool" :serial t :components ((:file "taskmaster")
                                            (:file "worker")
                                            (:file "growth")
                                            (:file "heap-guard")
                                            (:file "thread-maker")
                                            (:file "lifecycle")
                                            (:file "statistics")))
               (:module "engine/http" :serial t :components ((:file "string-kinds")
                                                   (:file "range-header")
                                                   (:file "known-names")
                                                   (:file "authority")
                                                   (:file "request-head")
                                                   (:file "conditional-headers")
                                                   (:file "octets-input-stream")
                                                   (:file "refusal-replies")
                                                   (:file "chunk-framing")
                                                   (:file "chunked-body")
                                                   (:file "cookie-header")
                                                   (:file "session-cookie")
                                                   (:file "content-coding")
                                                   (:file "reply-parts")
                                                   (:file "request-object")
                                                   (:file "reply-head")))
               (:module "engine/websocket" :serial t :components ((:file "utf-8")
                                                        (:file "frames")
                                                        (:file "handshake")))
               (:module "access-log" :serial t :components ((:file "access-log-line")
                                                  (:file "access-log-json")
                                                  (:file "access-log-batch")))
               (:module "engine/readiness" :serial t :components ((:file "memory-budget")
                                                        (:file "connection")
                                                        (:file "connection-socket")
                                                        (:file "arrived-octets")
                                                        (:file "counters")
                                                        (:file "http2-stream")
                                                        (:file "http2-session")
                                                        (:file "nghttp2-session")
                                                        (:file "timers")
                                                        (:file "readiness-set")
                                                        (:file "outgoing")
                                                        (:file "outbox")
                                                        (:file "websocket-message")
                                                        (:file "websocket-connection")
                                                        (:file "deferred-reply")
                                                        (:file "event-stream")
                                                        (:file "worker-tasks")
                                                        (:file "http2-connection")
                                                        (:file "arriving-body")
                                                        (:file "tls-handshake")
                                                        (:file "closing")
                                                        (:file "http2-reply")
                                                        (:file "http2-turn")
                                                        (:file "http2-event-stream")
                                                        (:file "engine")
                                                        (:file "parking")
                                                        (:file "accepting")
                                                        (:file "saturated-pool")
                                                        (:file "reply-batch")
                                                        (:file "statistics")
                                                        (:file "face")))
               (:module "engine/serving" :serial t :components ((:file "serving")
                                                      (:file "access-log-entries")
                                                      (:file "body-streams")
                                                      (:file "reply-coding")
                                                      (:file "reply-headers")
                                                      (:file "reply")
                                                      (:file "form-body")
                                                      (:file "request-cycle")
                                                      (:file "deferred-turn")
                                                      (:file "websocket-turn")
                                                      (:file "http2-streams")
                                                      (:file "connections")))
               (:file "engine/readiness-engine")
               (:file "websocket-sending")
               (:file "deferred-replies")
               (:file "event-streams")
               (:file "channels")
               (:file "acceptor-sessions")
               (:file "static-files")
               (:file "document-root")
               (:file "metrics"))
  :in-order-to ((test-op (test-op "hunchentoot-recycling-taskmaster/test"))))

(defsystem "hunchentoot-recycling-taskmaster/postgresql"
  :author "The hunchentoot-recycling-taskmaster authors"
  :version "0.1.0"
  :description "A session store in PostgreSQL shared by every process and
machine that uses the database: MAKE-POSTGRESQL-SESSION-STORE, for a parallel
acceptor's :SESSION-STORE."
  :license "BSD-2-Clause"
  :depends-on ("hunchentoot-recycling-taskmaster" "cl-postgres")
  :pathname "src/postgresql/"
  :serial t
  :components ((:file "cl-postgres-internals")
               (:file "connection-pool")
               (:file "session-schema")
               (:file "postgresql-store")
               (:file "event-bus")))

(defsystem "hunchentoot-recycling-taskmaster/postgresql-cluster"
  :author "The hunchentoot-recycling-taskmaster authors"
  :license "BSD-2-Clause"
  :version "0.1.0"
  :description "A throwaway PostgreSQL cluster, for the tests and the benchmark."
  :depends-on ((:require "sb-posix"))
  :pathname "tools/"
  :components ((:file "postgresql-cluster")))

(defsystem "hunchentoot-recycling-taskmaster/test"
  :author "The hunchentoot-recycling-taskmaster authors"
  :license "BSD-2-Clause"
  :version "0.1.0"
  :description "FiveAM tests: one HTTP behaviour suite and Hunchentoot's
extension points run against Hunchentoot's easy-acceptor and ours, the
thread-pool tests, the readiness engine over the wire, and STOP under load."
  :depends-on ("hunchentoot-recycling-taskmaster" "hunchentoot-recycling-taskmaster/postgresql"
               "hunchentoot-recycling-taskmaster/postgresql-cluster"
               "fiveam" "drakma" "cl+ssl" "flexi-streams" "cl-ppcre" (:require "sb-introspect"))
  :pathname "test/"
  :serial t
  :components ((:file "package")
               (:file "support")
               (:file "http-behaviour")
               (:file "pool")
               (:file "processors")
               (:file "overload")
               (:file "request-head")
               (:file "readiness-set")
               (:file "saturation")
               (:file "request-bodies")
               (:file "replies")
               (:file "request-fields")
               (:file "random-requests")
               (:file "static-files")
               (:file "compression")
               (:file "listening")
               (:file "metrics")
               (:file "access-log")
               (:file "garbage-input")
               (:file "extension-points")
               (:file "mixin-order")
               (:file "stop")
               (:file "slow-clients")
               (:file "reply-batch")
               (:file "tls-handshakes")
               (:file "tls-certificates")
               (:file "descriptor-limit")
               (:file "session-values")
               (:file "sessions")
               (:file "database-pool")
               (:file "postgresql-sessions")
               (:file "websocket-frames")
               (:file "websockets")
               (:file "permessage-deflate")
               (:file "http2")
               (:file "deferred-replies")
               (:file "event-streams")
               (:file "channel-bus")
               (:file "memory-budget")
               (:file "browser")
               (:file "house"))
  :perform (test-op (o c)
             (unless (symbol-call :hunchentoot-recycling-taskmaster-test :run-tests)
               (error "hunchentoot-recycling-taskmaster: tests failed"))))

(defsystem "hunchentoot-recycling-taskmaster/compatibility"
  :author "The hunchentoot-recycling-taskmaster authors"
  :license "BSD-2-Clause"
  :version "0.1.0"
  :description "The libraries users mix in -- easy-routes, Clack's Hunchentoot
handler, hunchensocket -- listed before and after a parallel acceptor,
against Hunchentoot's acceptor in the same place; and Hunchentoot's own
confidence test against both.  Needs their unchanged sources
(test/run-compatibility.lisp finds them)."
  :depends-on ("hunchentoot-recycling-taskmaster/test" "easy-routes" "hunchensocket"
               "clack-handler-hunchentoot" "cl-who")
  :pathname "test/"
  :components ((:file "compatibility")
               (:file "confidence-script")))

(defsystem "hunchentoot-recycling-taskmaster/bench"
  :author "The hunchentoot-recycling-taskmaster authors"
  :license "BSD-2-Clause"
  :version "0.1.0"
  :description "Benchmark servers started in their own process by bench/run,
the wrk matrix that measures them, and the many-connection loads."
  :depends-on ("hunchentoot-recycling-taskmaster" "hunchentoot-recycling-taskmaster/postgresql"
               "hunchentoot-recycling-taskmaster/postgresql-cluster" "aserve" "cl-ppcre" "usocket"
               (:require "sb-sprof"))
  :pathname "bench/"
  :serial t
  :components ((:file "server")
               (:file "peers")
               (:file "driver")
               (:file "connections")
               (:file "slow-clients")
               (:file "https")
               (:file "scale")
               (:file "chunked-body")
               (:file "sessions")
               (:file "applications")
               (:file "profile")
               (:file "perf-profile")
               (:file "websockets")
               (:file "threaded-floor")
               (:file "engine-floor")
               (:file "protocol-floor")
               (:file "scheduling")
               (:file "events")
               (:file "per-core")
               (:file "same-moment")
               (:file "compression")
               (:file "http2")
               (:file "access-log")
               (:file "production")
               (:file "memory")))

(defsystem "hunchentoot-recycling-taskmaster/demo"
  :author "The hunchentoot-recycling-taskmaster authors"
  :license "BSD-2-Clause"
  :version "0.1.0"
  :description "The demo server that `make run` starts."
  :depends-on ("hunchentoot-recycling-taskmaster" "hunchentoot-recycling-taskmaster/postgresql"
               "flexi-streams" (:require "sb-posix"))
  :pathname "demo/"
  :components ((:file "demo")))
