;;;; The readiness engine: the CONNECTION-ENGINE (engine/protocol.lisp) whose
;;;; workers wait on the acceptor's readiness set.  Woken for the listening
;;;; socket a worker accepts a connection, woken for a parked connection it
;;;; takes it; either way it serves the connection (serving/) and parks it
;;;; again, with the bytes of a partial head if any, as soon as the socket
;;;; has nothing more.  A thread is held only while a head is parsed, a step
;;;; of a TLS handshake taken or a request answered.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +sweep-interval-seconds+ 1/4
  "How often parked connections whose deadline has passed are ended (the
precision of the header and keep-alive timeouts), and accepting resumes
after it paused.")

(defclass readiness-engine (connection-engine)
  ((set :initform nil :accessor engine-readiness-set
        :documentation "The READINESS-SET of the current run; NIL while the
acceptor is stopped.")
   (counters :initform (make-connection-counters) :reader engine-counters
             :documentation "What the readiness sets of every run have counted.")
   (object-constructors :initform nil :accessor engine-object-constructors
                        :documentation "The OBJECT-CONSTRUCTORS of the current run.")
   (plain-streams-reset-p :initform t :accessor engine-plain-streams-reset-p
                          :documentation "False when, as at the start of the
current run, HUNCHENTOOT:RESET-CONNECTION-STREAM need not be called on a
plain connection's own stream (serving.lisp, PLAIN-STREAMS-RESET-P).")
   (certificates :initform nil :accessor engine-certificates
                 :documentation "The SERVER-CERTIFICATES of the current run
when the engine takes the acceptor's TLS handshakes, else NIL.")
   (certificate-counters :initform (make-certificate-counters) :reader engine-certificate-counters
                         :documentation "What the certificates of every run have counted.")
   (sweep-buffer :initform nil :accessor engine-sweep-buffer
                 :documentation "Where the thread-making thread peeks at what has
arrived on parked connections while no worker is free (saturated-pool.lisp)."))
  (:documentation "The :READINESS-SET connection engine: one epoll set holding
the listening socket and every connection waiting for bytes, shared by
every worker."))

(defmethod make-connection-engine ((taskmaster recycling-taskmaster))
  (make-instance 'readiness-engine :taskmaster taskmaster))

(defun engine-acceptor (engine)
  (hunchentoot:taskmaster-acceptor (engine-taskmaster engine)))

(defun engine-stopping-test (engine)
  "A function of no argument, true once HUNCHENTOOT:STOP has begun on
ENGINE's acceptor or its taskmaster is shutting down, whichever is first."
  (let ((taskmaster (engine-taskmaster engine))
        (acceptor (engine-acceptor engine)))
    (lambda ()
      (or (shutting-down-p taskmaster)
          (acceptor-shutting-down-p acceptor)))))

(declaim (inline stopping-p))
(defun stopping-p (set)
  "True once the owner of SET has begun to stop: no connection is to be
parked again."
  (funcall (readiness-set-stopping-test set)))

(defun milliseconds-until (deadline)
  (max 0 (ceiling (* 1000 (- deadline (get-internal-real-time))) internal-time-units-per-second)))
