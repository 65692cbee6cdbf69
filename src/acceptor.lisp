;;;; The acceptor family: Hunchentoot's four acceptors with a
;;;; RECYCLING-TASKMASTER by default, and the forced teardown.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass parallel-acceptor (hunchentoot:acceptor)
  ()
  (:default-initargs
   :taskmaster (make-instance 'recycling-taskmaster))
  (:documentation "HUNCHENTOOT:ACCEPTOR served by a RECYCLING-TASKMASTER:
pooled worker threads accept in parallel on the listening socket.  Give
:TASKMASTER (MAKE-INSTANCE 'RECYCLING-TASKMASTER ...) to size the pool."))

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

(defun abandon-pool (taskmaster)
  "End every thread of TASKMASTER by force and forget them."
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) t))
  (let* ((workers (with-pool-lock (taskmaster) (copy-list (pool-workers taskmaster))))
         (threads (remove (bt:current-thread)
                          (remove nil (cons (thread-maker taskmaster)
                                            (mapcar #'worker-thread workers))))))
    (dolist (thread threads)
      (ignore-errors (bt:destroy-thread thread)))
    (dolist (thread threads)
      (join-thread-within thread 2))
    (dolist (worker workers)
      (when (worker-socket worker)
        (ignore-errors (usocket:socket-close (worker-socket worker))))))
  (dolist (socket (take-queued-connections taskmaster))
    (ignore-errors (usocket:socket-close socket)))
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
