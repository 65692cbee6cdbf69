;;;; A pool of PostgreSQL connections for one process: a request's store
;;;; call takes a connection for one statement and gives it back, so a
;;;; process holds at most MAX-SIZE connections whatever its worker count,
;;;; and never opens one per request.
;;;;
;;;; Locking: the pool's LOCK guards IDLE, OPEN-COUNT and the state of its
;;;; attempts to connect (FAILURE, FAILED-AT, PROBING); a connection is
;;;; opened and used outside it.  A thread waits on AVAILABLE for a
;;;; connection when all MAX-SIZE are in use; the caller's deadline (see
;;;; CALL-WITH-SESSION-STORE) ends that wait, as every other.
;;;;
;;;; A connection whose use ended by a non-local exit (a deadline in the
;;;; middle of a statement, a broken socket) is closed, never given back:
;;;; its protocol state is unknown.  A statement the server refused
;;;; (an error response) leaves it in sync, and it is given back.  At a deadline its socket is shut down
;;;; before anything unwinds, since cl-postgres's own cleanups would wait
;;;; for the rest of the server's reply.  When a connection that served an
;;;; earlier statement turns out broken, the idle ones are closed too (a
;;;; restarted server broke them all) and the statement is tried once
;;;; more, on a new connection unless another thread gave one back
;;;; meanwhile; a failure of that second try is the caller's.
;;;;
;;;; Once an attempt to connect has failed, the pool makes one attempt at a
;;;; time, at most one every RECONNECT-INTERVAL, until one succeeds; a call
;;;; that needs a new connection meanwhile fails at once with
;;;; DATABASE-UNREACHABLE.  A server that refuses connections answers each
;;;; attempt in microseconds, and cl-postgres leaves the socket of an attempt
;;;; that failed to the garbage collector: unbounded, the requests of an
;;;; outage would spend the process's descriptors, and storm the server with
;;;; connections when it comes back.

(in-package #:hunchentoot-recycling-taskmaster)

(define-condition database-unreachable (error)
  ((failure :initarg :failure :reader database-unreachable-failure
            :documentation "The condition the pool's last attempt to connect failed with."))
  (:report (lambda (condition stream)
             (format stream "the pool's last attempt to connect failed (~A); the next is not due yet"
                     (database-unreachable-failure condition))))
  (:documentation "Signalled by a call of a DATABASE-POOL that needs a new
connection while the pool holds its attempts to connect back: the last one
failed, and another is under way or not due yet."))

(defstruct (database-pool (:constructor make-database-pool (connect max-size &optional reconnect-interval)))
  "The connections of one process to one database."
  ;; A function of no arguments returning a new open cl-postgres connection,
  ;; ready for the statements of the pool's user.
  (connect nil :type function :read-only t)
  ;; The most connections open at once.
  (max-size 8 :type (integer 1) :read-only t)
  ;; Seconds between attempts to connect once one has failed.
  (reconnect-interval 1/10 :type (real 0) :read-only t)
  ;; Open connections no thread is using.
  (idle '() :type list)
  ;; Connections open, idle or in use, or being opened.
  (open-count 0 :type (integer 0))
  ;; The condition the last attempt to connect failed with, or NIL when it
  ;; succeeded; and the internal real time it failed at.
  (failure nil)
  (failed-at 0 :type integer)
  ;; True while the one attempt to connect made after a failure is under way.
  (probing nil)
  (lock (bt:make-lock "database pool") :read-only t)
  (available (bt:make-condition-variable :name "database connection available") :read-only t))

(defun broken-connection-error-p (condition)
  "True when CONDITION says a connection (rather than a statement) failed."
  (typep condition '(or cl-postgres:database-connection-error stream-error
                        cl-postgres-error:server-shutdown cl-postgres-error:admin-shutdown)))

(defun close-database-connection (connection)
  "Close CONNECTION without waiting for the server."
  (ignore-errors (cl-postgres:close-database connection)))

(defun claim-connection-attempt (pool)
  "Whether this thread may try to open a connection of POOL now, the pool's
lock held: T while connecting works; after a failed attempt, :PROBE when no
other attempt is under way and the reconnect interval has passed since the
failure (this thread's attempt is then the one under way), else NIL."
  (cond ((null (database-pool-failure pool)) t)
        ((or (database-pool-probing pool)
             (< (- (get-internal-real-time) (database-pool-failed-at pool))
                (* (database-pool-reconnect-interval pool) internal-time-units-per-second)))
         nil)
        (t (setf (database-pool-probing pool) t)
           :probe)))

(defun take-database-connection (pool)
  "An open connection of POOL for this thread, and true when it was idle
(opened for an earlier statement) rather than opened now.  Signals
DATABASE-UNREACHABLE when a connection would have to be opened while the
pool holds its attempts back."
  (let ((failure
          (loop
            (bt:with-lock-held ((database-pool-lock pool))
              (cond ((database-pool-idle pool)
                     (return-from take-database-connection (values (pop (database-pool-idle pool)) t)))
                    ((< (database-pool-open-count pool) (database-pool-max-size pool))
                     (let ((attempt (claim-connection-attempt pool)))
                       (unless attempt
                         (return (database-pool-failure pool)))
                       (incf (database-pool-open-count pool))
                       (return-from take-database-connection
                         (values (open-pooled-connection pool (eq attempt :probe)) nil))))
                    (t
                     (bt:condition-wait (database-pool-available pool) (database-pool-lock pool))))))))
    (error 'database-unreachable :failure failure)))

(defun open-pooled-connection (pool probe)
  "A new connection of POOL, counted in its OPEN-COUNT (already incremented,
under the lock, which is released while the connection is opened); PROBE
true when it is the one attempt after a failure.  The attempt's outcome is
recorded for CLAIM-CONNECTION-ATTEMPT."
  (let ((connection nil) (failure nil))
    (bt:release-lock (database-pool-lock pool))
    (unwind-protect
         (handler-bind ((serious-condition (lambda (condition) (setf failure condition))))
           (setf connection (funcall (database-pool-connect pool))))
      (bt:acquire-lock (database-pool-lock pool))
      (when probe
        (setf (database-pool-probing pool) nil))
      (if connection
          (setf (database-pool-failure pool) nil)
          (progn
            (setf (database-pool-failure pool) failure
                  (database-pool-failed-at pool) (get-internal-real-time))
            (decf (database-pool-open-count pool))
            (bt:condition-notify (database-pool-available pool)))))
    connection))

(defun give-back-database-connection (pool connection)
  "Make CONNECTION, which ended its statement normally, idle in POOL."
  (bt:with-lock-held ((database-pool-lock pool))
    (push connection (database-pool-idle pool))
    (bt:condition-notify (database-pool-available pool))))

(defun drop-database-connection (pool connection &key idle-too)
  "Close CONNECTION and forget it; with IDLE-TOO, close the idle connections too."
  (close-database-connection connection)
  (let ((idle '()))
    (bt:with-lock-held ((database-pool-lock pool))
      (when idle-too
        (rotatef idle (database-pool-idle pool)))
      (decf (database-pool-open-count pool) (1+ (length idle)))
      (bt:condition-notify (database-pool-available pool)))
    (mapc #'close-database-connection idle)))

(defun call-on-database-connection (pool function may-retry)
  "FUNCTION called with a connection of POOL: a list of its values, and NIL;
or, when MAY-RETRY and the connection turned out broken after serving an
earlier statement, NIL and true, that connection closed with the idle ones."
  (multiple-value-bind (connection reused) (take-database-connection pool)
    (let ((done nil) (cut nil))
      (unwind-protect
           (handler-bind ((error (lambda (condition)
                                   (when (and (not cut)
                                              (typep condition 'cl-postgres:database-error)
                                              (not (broken-connection-error-p condition)))
                                     ;; The server refused the statement; cl-postgres
                                     ;; syncs the connection as the error unwinds.
                                     (setf done :refused))
                                   (when (and may-retry reused (not cut) (broken-connection-error-p condition))
                                     (drop-database-connection pool connection :idle-too t)
                                     (setf done :dropped)
                                     (return-from call-on-database-connection (values nil t)))))
                          ;; cl-postgres's cleanups read the rest of a reply while
                          ;; they unwind, past the deadline: cut the socket first.
                          (deadline-passed (lambda (condition)
                                             (declare (ignore condition))
                                             (setf cut t)
                                             (cut-database-connection connection))))
             (multiple-value-prog1 (values (multiple-value-list (funcall function connection)) nil)
               (setf done t)))
        (case done
          ((t :refused) (give-back-database-connection pool connection))
          ((nil) (drop-database-connection pool connection)))))))

(defun call-with-database-connection (pool function)
  "FUNCTION called with a connection of POOL; its values.  When a connection
that served an earlier statement turns out broken, the call is made once
more (see the header)."
  (multiple-value-bind (results broken) (call-on-database-connection pool function t)
    (values-list (if broken
                     (call-on-database-connection pool function nil)
                     results))))

(defmacro with-database-connection ((connection pool) &body body)
  "Run BODY with CONNECTION bound to a connection of POOL, as CALL-WITH-DATABASE-CONNECTION."
  `(call-with-database-connection ,pool (lambda (,connection) ,@body)))

(defun close-database-pool (pool)
  "Close POOL's idle connections."
  (let ((idle '()))
    (bt:with-lock-held ((database-pool-lock pool))
      (rotatef idle (database-pool-idle pool))
      (decf (database-pool-open-count pool) (length idle)))
    (mapc #'close-database-connection idle)))
