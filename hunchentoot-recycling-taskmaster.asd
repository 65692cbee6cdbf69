;;;; ASDF systems: the library, its tests, its benchmarks.

(defsystem "hunchentoot-recycling-taskmaster"
  :description "A Hunchentoot taskmaster whose pooled worker threads share the
listening socket and an epoll readiness set of the connections waiting for
requests, with acceptors that use it by default."
  :license "BSD-2-Clause"
  :version "0.1.0"
  :depends-on ("hunchentoot" "usocket" "bordeaux-threads" "chunga" "cl-ppcre"
               "flexi-streams" (:feature :sbcl "sb-bsd-sockets"))
  :pathname "src/"
  :serial t
  :components ((:file "package")
               (:file "sbcl")
               (:file "hunchentoot-internals")
               (:file "conditions")
               (:file "request-head")
               (:file "readiness-set")
               (:file "taskmaster")
               (:file "acceptor")
               (:file "connection")
               (:file "readiness-engine"))
  :in-order-to ((test-op (test-op "hunchentoot-recycling-taskmaster/test"))))

(defsystem "hunchentoot-recycling-taskmaster/test"
  :description "FiveAM tests: one HTTP behaviour suite run against Hunchentoot's
easy-acceptor and ours, and the thread-pool tests."
  :depends-on ("hunchentoot-recycling-taskmaster" "fiveam" "drakma" "cl+ssl"
               "flexi-streams" "cl-ppcre")
  :pathname "test/"
  :serial t
  :components ((:file "package")
               (:file "support")
               (:file "http-behaviour")
               (:file "pool")
               (:file "overload")
               (:file "request-head")
               (:file "readiness-set")
               (:file "garbage-input"))
  :perform (test-op (o c)
             (unless (symbol-call :hunchentoot-recycling-taskmaster-test :run-tests)
               (error "hunchentoot-recycling-taskmaster: tests failed"))))

(defsystem "hunchentoot-recycling-taskmaster/bench"
  :description "Benchmark servers started in their own process by bench/run,
the wrk matrix that measures them, and the many-connection loads."
  :depends-on ("hunchentoot-recycling-taskmaster" "aserve" "cl-ppcre" "usocket")
  :pathname "bench/"
  :serial t
  :components ((:file "server")
               (:file "driver")
               (:file "connections")))

(defsystem "hunchentoot-recycling-taskmaster/demo"
  :description "The demo server that `make run` starts."
  :depends-on ("hunchentoot-recycling-taskmaster")
  :pathname "demo/"
  :components ((:file "demo")))
