;;;; The recycling taskmaster this project started from, as a benchmark peer
;;;; (bench/driver.lisp's *PEERS*): loaded from ../shared/vendor into an SBCL
;;;; of its own (its system has this project's name), its core saved once
;;;; per run, serving with its PARALLEL-EASY-ACCEPTOR at its defaults.  GET
;;;; /yo answers 200 text/plain "Hey!", after sleeping DELAY-MS when it is
;;;; not 0.

(defpackage #:bench-peer
  (:use #:cl)
  (:export #:serve))

(in-package #:bench-peer)

(defvar *delay* nil "Seconds each /yo request sleeps, or NIL.")

(hunchentoot:define-easy-handler (yo :uri "/yo") ()
  (when *delay*
    (sleep *delay*))
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(defun serve (port delay-ms)
  "Serve GET /yo on 127.0.0.1:PORT until killed."
  (setf *delay* (and (plusp delay-ms) (/ delay-ms 1000)))
  (hunchentoot:start (make-instance 'hunchentoot-recycling-taskmaster:parallel-easy-acceptor
                                    :address "127.0.0.1" :port port :access-log-destination nil))
  (loop (sleep 3600)))
