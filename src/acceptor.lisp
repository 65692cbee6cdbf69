;;;; The acceptor family: Hunchentoot's four acceptors with a
;;;; RECYCLING-TASKMASTER by default, their initargs and their checks.
;;;; Starting, stopping and abandoning them is pool/lifecycle.lisp.

(in-package #:hunchentoot-recycling-taskmaster)

(defgeneric acceptor-connection-engine (acceptor)
  (:documentation "The name of the connection engine ACCEPTOR's workers
serve with: :READINESS-SET, the only one there is."))

(defgeneric acceptor-header-timeout (acceptor)
  (:documentation "Seconds a request head may take to arrive before ACCEPTOR
answers 408."))

(defgeneric acceptor-keep-alive-timeout (acceptor)
  (:documentation "Seconds ACCEPTOR keeps an idle kept-alive connection open."))

(defgeneric acceptor-queue-timeout (acceptor)
  (:documentation "Seconds a complete request may wait for a free worker of
ACCEPTOR before it is answered 503 with Retry-After."))

(defgeneric acceptor-max-header-bytes (acceptor)
  (:documentation "The largest header block ACCEPTOR answers; a larger one
gets 431."))

(defclass parallel-acceptor (hunchentoot:acceptor)
  ((connection-engine
    :initarg :connection-engine :reader acceptor-connection-engine
    :documentation ":READINESS-SET, the only engine: connections waiting for
bytes are parked in an epoll set and hold no thread; workers wait on the set
and serve whatever is ready.")
   (header-timeout
    :initarg :header-timeout :reader acceptor-header-timeout
    :documentation "Seconds a request head (request line and headers) may
take to arrive, counted from the connection's accept or from the head's
first byte; then the client gets 408 and the connection is closed.")
   (keep-alive-timeout
    :initarg :keep-alive-timeout :reader acceptor-keep-alive-timeout
    :documentation "Seconds a kept-alive connection may wait for its next
request before it is closed.")
   (queue-timeout
    :initarg :queue-timeout :reader acceptor-queue-timeout
    :documentation "Seconds a request whose head has arrived may wait for a
free worker, when every worker the pool may have is busy; then the client
gets 503 with Retry-After (these seconds, rounded up) and the connection
is closed.  The header timeout ends when the head is complete.")
   (max-header-bytes
    :initarg :max-header-bytes :reader acceptor-max-header-bytes
    :documentation "The largest header block (the lines after the request
line) answered; a larger one gets 431.  A request line over 8 KiB gets 414,
more than 100 header lines 431."))
  (:default-initargs
   :taskmaster (make-instance 'recycling-taskmaster)
   :connection-engine :readiness-set
   :header-timeout 10
   :keep-alive-timeout 5
   :queue-timeout 10
   :max-header-bytes 16384
   :listen-backlog 511)
  (:documentation "HUNCHENTOOT:ACCEPTOR served by a RECYCLING-TASKMASTER:
pooled worker threads share the listening socket and the connections that
wait for requests.  Give :TASKMASTER (MAKE-INSTANCE 'RECYCLING-TASKMASTER
...) to size the pool.  HUNCHENTOOT:ACCEPTOR-READ-TIMEOUT still bounds each
read of a request body and a TLS handshake, HUNCHENTOOT:ACCEPTOR-WRITE-TIMEOUT
each write of a reply; HEADER-TIMEOUT and KEEP-ALIVE-TIMEOUT bound the waits
between requests, QUEUE-TIMEOUT the wait of a request for a free worker.  Each time a worker takes a connection up, it serves the
requests that have arrived inside HUNCHENTOOT:PROCESS-CONNECTION, so that
:AROUND methods of mixins run around them."))

(defmethod initialize-instance :after ((acceptor parallel-acceptor) &key)
  (unless (eq (acceptor-connection-engine acceptor) :readiness-set)
    (error 'invalid-acceptor-configuration
           :initarg :connection-engine :value (acceptor-connection-engine acceptor)
           :reason "must be :READINESS-SET (the blocking engine was retired)"))
  (loop for (initarg seconds) in `((:header-timeout ,(acceptor-header-timeout acceptor))
                                   (:keep-alive-timeout ,(acceptor-keep-alive-timeout acceptor))
                                   (:queue-timeout ,(acceptor-queue-timeout acceptor)))
        unless (and (realp seconds) (plusp seconds))
          do (error 'invalid-acceptor-configuration
                    :initarg initarg :value seconds
                    :reason "must be a positive number of seconds"))
  ;; Hunchentoot on SBCL has one timeout per socket for both directions, and
  ;; otherwise signals its error at every accept, after the connection is made.
  (unless (eql (hunchentoot:acceptor-read-timeout acceptor) (hunchentoot:acceptor-write-timeout acceptor))
    (error 'invalid-acceptor-configuration
           :initarg :write-timeout :value (hunchentoot:acceptor-write-timeout acceptor)
           :reason (format nil "must equal :READ-TIMEOUT (~S): on SBCL one timeout bounds ~
                                both reads and writes"
                           (hunchentoot:acceptor-read-timeout acceptor))))
  (let ((bytes (acceptor-max-header-bytes acceptor)))
    (unless (and (integerp bytes) (<= 1024 bytes (* 1024 1024)))
      (error 'invalid-acceptor-configuration
             :initarg :max-header-bytes :value bytes
             :reason "must be an integer from 1024 to 1048576"))))

(defclass parallel-easy-acceptor (parallel-acceptor hunchentoot:easy-acceptor)
  ()
  (:documentation "HUNCHENTOOT:EASY-ACCEPTOR served by a RECYCLING-TASKMASTER:
DEFINE-EASY-HANDLER handlers and static files work as with EASY-ACCEPTOR."))

(defclass parallel-ssl-acceptor (parallel-acceptor hunchentoot:ssl-acceptor)
  ()
  (:documentation "HUNCHENTOOT:SSL-ACCEPTOR served by a RECYCLING-TASKMASTER.
Takes the same :SSL-CERTIFICATE-FILE, :SSL-PRIVATEKEY-FILE and
:SSL-PRIVATEKEY-PASSWORD initargs."))

(defclass parallel-easy-ssl-acceptor (parallel-easy-acceptor parallel-ssl-acceptor
                                      hunchentoot:easy-ssl-acceptor)
  ()
  (:documentation "HUNCHENTOOT:EASY-SSL-ACCEPTOR served by a RECYCLING-TASKMASTER."))
