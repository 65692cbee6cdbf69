;;;; The acceptor family: Hunchentoot's four acceptors with a
;;;; RECYCLING-TASKMASTER by default, and the forced teardown.

(in-package #:hunchentoot-recycling-taskmaster)

(defgeneric acceptor-connection-engine (acceptor)
  (:documentation "How ACCEPTOR's workers read requests: :READINESS-SET or :BLOCKING."))

(defgeneric acceptor-header-timeout (acceptor)
  (:documentation "Seconds a request head may take to arrive before the
:READINESS-SET engine answers 408."))

(defgeneric acceptor-keep-alive-timeout (acceptor)
  (:documentation "Seconds the :READINESS-SET engine keeps an idle
kept-alive connection open."))

(defgeneric acceptor-max-header-bytes (acceptor)
  (:documentation "The largest header block the :READINESS-SET engine
answers; a larger one gets 431."))

(defclass parallel-acceptor (hunchentoot:acceptor)
  ((connection-engine
    :initarg :connection-engine :reader acceptor-connection-engine
    :documentation ":READINESS-SET (the default): connections waiting for a
request are parked in an epoll set and hold no thread; workers wait on the
set and serve whatever is ready.  :BLOCKING: each worker holds its
connection from accept to close, reading with Hunchentoot's own request
reader, as Hunchentoot's taskmasters do (HEADER-TIMEOUT, KEEP-ALIVE-TIMEOUT
and MAX-HEADER-BYTES do not apply; READ-TIMEOUT does).")
   (header-timeout
    :initarg :header-timeout :reader acceptor-header-timeout
    :documentation "Seconds a request head (request line and headers) may
take to arrive, counted from the connection's accept or from the head's
first byte; then the client gets 408 and the connection is closed.")
   (keep-alive-timeout
    :initarg :keep-alive-timeout :reader acceptor-keep-alive-timeout
    :documentation "Seconds a kept-alive connection may wait for its next
request before it is closed.")
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
   :max-header-bytes 16384)
  (:documentation "HUNCHENTOOT:ACCEPTOR served by a RECYCLING-TASKMASTER:
pooled worker threads share the listening socket and the connections that
wait for requests.  Give :TASKMASTER (MAKE-INSTANCE 'RECYCLING-TASKMASTER
...) to size the pool.  HUNCHENTOOT:ACCEPTOR-READ-TIMEOUT still bounds each
read of a request body and HUNCHENTOOT:ACCEPTOR-WRITE-TIMEOUT each write of
a reply; with the :READINESS-SET engine, HEADER-TIMEOUT and
KEEP-ALIVE-TIMEOUT bound the waits between requests."))

(defmethod initialize-instance :after ((acceptor parallel-acceptor) &key)
  (unless (member (acceptor-connection-engine acceptor) '(:readiness-set :blocking))
    (error 'invalid-acceptor-configuration
           :initarg :connection-engine :value (acceptor-connection-engine acceptor)
           :reason "must be :READINESS-SET or :BLOCKING"))
  (loop for (initarg seconds) in `((:header-timeout ,(acceptor-header-timeout acceptor))
                                   (:keep-alive-timeout ,(acceptor-keep-alive-timeout acceptor)))
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

(defun recycling-taskmaster-of (acceptor)
  (let ((taskmaster (acceptor-taskmaster acceptor)))
    (and (typep taskmaster 'recycling-taskmaster) taskmaster)))

(defmethod hunchentoot:start :around ((acceptor parallel-acceptor))
  (catch 'acceptor-abandoned
    (call-next-method))
  acceptor)

(defmethod hunchentoot:stop :around ((acceptor parallel-acceptor) &key soft)
  ;; HUNCHENTOOT:SHUTDOWN is not told whether the stop is soft.
  (when (hunchentoot:started-p acceptor)
    (let ((taskmaster (recycling-taskmaster-of acceptor)))
      (when taskmaster
        (setf (soft-stop-p taskmaster) soft)))
    (catch 'acceptor-abandoned
      (call-next-method)))
  acceptor)

(defun end-threads-by-force (threads)
  "BT:DESTROY-THREAD each of THREADS but the calling one, then join each,
waiting up to 2 s for it."
  (let ((threads (remove (bt:current-thread) (remove nil threads))))
    (dolist (thread threads)
      (ignore-errors (bt:destroy-thread thread)))
    (dolist (thread threads)
      (join-thread-within thread 2))))

(defun abandon-pool (taskmaster)
  "End every thread of TASKMASTER by force and forget them.  The
thread-making thread ends first: a worker it made after the workers were
listed would outlive the pool, and its exit would count below zero."
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) t))
  (end-threads-by-force (list (thread-maker taskmaster)))
  (let ((workers (with-pool-lock (taskmaster) (copy-list (pool-workers taskmaster)))))
    ;; A worker made just before the maker ended records its thread as it starts.
    (loop repeat 200
          while (some (lambda (worker) (null (worker-thread worker))) workers)
          do (sleep 0.01))
    (end-threads-by-force (mapcar #'worker-thread workers))
    (dolist (worker workers)
      (when (worker-socket worker)
        (ignore-errors (usocket:socket-close (worker-socket worker))))))
  (dolist (socket (take-queued-connections taskmaster))
    (ignore-errors (usocket:socket-close socket)))
  (let ((set (taskmaster-readiness-set taskmaster)))
    (when set
      (close-every-connection set)
      (retire-readiness-set taskmaster)))
  (with-pool-state-change (taskmaster)
    (setf (pool-workers taskmaster) '()
          (thread-maker taskmaster) nil
          (pool-thread-count taskmaster) 0
          (pending-thread-count taskmaster) 0
          (accepting-count taskmaster) 0
          (busy-count taskmaster) 0
          (overflow-accepting-p taskmaster) nil)
    (notify-pool-changed taskmaster)))

(defun abandon-acceptor (acceptor)
  "Tear ACCEPTOR down by force, for when HUNCHENTOOT:STOP cannot: every
worker thread and the thread-making thread are ended with
BT:DESTROY-THREAD (their UNWIND-PROTECT cleanups run, in-flight requests are
cut off), every connection and the listening socket are closed, and the
port can be listened on again at once.  The acceptor can be started again
afterwards.  Safe to call on an acceptor that is stopped or half-started.
Returns ACCEPTOR.  Unspecified: what a client whose request was cut off
receives."
  (setf (acceptor-shutting-down-p acceptor) t)
  (let ((listen-socket (acceptor-listen-socket acceptor))
        (taskmaster (recycling-taskmaster-of acceptor)))
    (when listen-socket
      (wake-accepting-threads listen-socket))
    (when taskmaster
      (abandon-pool taskmaster))
    (when listen-socket
      (ignore-errors (usocket:socket-close listen-socket))
      (setf (acceptor-listen-socket acceptor) nil)))
  acceptor)

(defmethod taskmaster-statistics ((acceptor parallel-acceptor))
  "The statistics of ACCEPTOR's taskmaster, for code that holds the acceptor
(Hunchentoot does not export the taskmaster reader)."
  (taskmaster-statistics (acceptor-taskmaster acceptor)))
