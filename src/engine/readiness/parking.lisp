;;;; Parking a connection until what it waits for happens -- the rest of a
;;;; head, more of a body, room for the rest of a reply, the client's next
;;;; TLS record -- each under its own deadline; and a worker's wait for the
;;;; next connection ready.

(in-package #:hunchentoot-recycling-taskmaster)

(defun park-until (set connection deadline)
  "Park CONNECTION, which the caller holds, until bytes arrive or DEADLINE
passes; close it instead when the pool is stopping or the descriptor cannot
be armed.  Stopping is asked once, after parking: HUNCHENTOOT:STOP sets its
flag, then closes what is parked, so a connection parked as it begins is
closed by one or the other; asked before parking too, it was two more
generic calls a request (bench/profiles/2026-12-04-settings-a-run.txt)."
  (cond ((park-connection set connection deadline)
         (memory-barrier)
         (when (and (stopping-p set) (take-parked-connection connection))
           (close-connection set connection)))
        (t (close-connection set connection))))

(defun park-or-end (set connection buffer end)
  "Park CONNECTION with the END octets of BUFFER (the start of a head, or
none) until more arrive; end it instead if its deadline has passed or the
pool is stopping."
  (let* ((now (get-internal-real-time))
         (head-started (connection-head-started connection))
         (deadline (if head-started
                       (+ head-started (readiness-set-header-timeout set))
                       (+ now (readiness-set-keep-alive-timeout set)))))
    (setf (connection-timeout-status connection) (and head-started 408))
    ;; The pool's stopping is PARK-UNTIL's to see, after it parks.
    (cond ((<= deadline now) (end-parked-connection set connection))
          (t
           (keep-pending-bytes connection buffer end (readiness-set-memory-budget set))
           (park-until set connection deadline)))))

(defun park-until-writable (set connection buffer end)
  "Park CONNECTION, whose reply its socket did not take whole, until the
socket has room, keeping the END octets of BUFFER (requests the client
sent meanwhile); the client has the write timeout to take more, and again
each time it has taken some (CLIENT-TOOK-OCTETS-P)."
  (keep-pending-bytes connection buffer end (readiness-set-memory-budget set))
  (setf (connection-awaiting connection) :output
        (connection-timeout-status connection) nil)
  (note-unacknowledged-octets connection)
  (park-until set connection (+ (get-internal-real-time) (readiness-set-write-timeout set))))

(defun park-until-body-arrives (set connection)
  "Park CONNECTION, held by the caller, until more of its ARRIVING-BODY
comes; it is answered 408 if nothing does for the read timeout."
  (setf (connection-awaiting connection) :input
        (connection-timeout-status connection) nil)
  (park-until set connection (+ (get-internal-real-time) (readiness-set-read-timeout set))))

(defun park-during-handshake (set connection awaiting)
  "Park CONNECTION, held by the caller, until its socket is ready for
AWAITING (:INPUT or :OUTPUT), as its handshake wants, for no longer than
the header timeout from the accept."
  (setf (connection-awaiting connection) awaiting
        (connection-timeout-status connection) nil)
  (park-until set connection
              (+ (connection-head-started connection) (readiness-set-header-timeout set))))

;;; Waking.

(defconstant +ready-tokens-per-wait+ 16
  "The most events a worker takes from one epoll_wait after a quick request:
the first it serves, the rest wait in the set's queue of tasks for it or
any worker (worker-tasks.lisp).")

(defun take-reported-tokens (set sap count)
  "Of the COUNT tokens EPOLL-WAIT-INTO wrote at SAP, the one to serve now,
or NIL when there was only the wakeup descriptor's (level-triggered, it
means stop: seen at the top of the wait).  The timer or task descriptor
goes first, the other armed again: one-shot, neither is ever queued, and
neither may wait behind a descriptor reported at every wait (the listening
socket hung up by a soft STOP, level-triggered).  The connections and the
listening socket not served now are queued for any worker."
  (let ((descriptor nil)
        (queued '()))
    (dotimes (index count)
      (let ((token (reported-token sap index)))
        (cond ((= token +wakeup-token+))
              ((not (or (= token +timer-token+) (= token +task-token+))) (push token queued))
              ((null descriptor) (setf descriptor token))
              (t (rearm-own-descriptor set token)))))
    (setf queued (nreverse queued))
    (let ((first (or descriptor (pop queued))))
      ;; The queued ones wait for a worker: time for their memory to come.
      (dolist (token queued)
        (prefetch-reported-connection set token))
      (queue-worker-tasks set queued)
      first)))

(defun next-ready-token (engine worker set)
  "Wait on SET until WORKER has something to serve: the token reported, or
NIL when WORKER is to end (the pool is stopping, or WORKER is surplus).
After a quick request WORKER takes up to +READY-TOKENS-PER-WAIT+ events
from one epoll_wait, as nginx's loop does: at a 0 ms handler, a system
call in three a request (bench/profiles/2026-11-28-ready-tokens.txt).
After a long one it takes one, since a handler that waits would hold up
the others behind it until the nudge."
  (let ((taskmaster (engine-taskmaster engine)))
    (unless (begin-waiting taskmaster worker)
      (return-from next-ready-token nil))
    (flet ((idle-deadline ()
             (deadline-in (taskmaster-thread-idle-timeout taskmaster))))
      (let ((idle-deadline (idle-deadline))
            (capacity (if (worker-last-request-long-p worker) 1 +ready-tokens-per-wait+)))
        (sb-alien:with-alien ((events (array (sb-alien:unsigned 8)
                                             #.(* +ready-tokens-per-wait+ +epoll-event-bytes+))))
          (let ((sap (sb-alien:alien-sap events)))
            (loop
              (when (shutting-down-p taskmaster)
                (note-stopped-waiting taskmaster worker)
                (return nil))
              (let ((count (epoll-wait-into (readiness-set-epoll-fd set) (milliseconds-until idle-deadline)
                                            sap capacity)))
                (case count
                  (:interrupted)
                  (:timeout
                   (when (>= (get-internal-real-time) idle-deadline)
                     (when (note-wait-timed-out taskmaster worker)
                       (return nil))
                     (setf idle-deadline (idle-deadline))))
                  (t
                   (let ((token (take-reported-tokens set sap count)))
                     (when token
                       (note-woken taskmaster worker)
                       (return token)))))))))))))
