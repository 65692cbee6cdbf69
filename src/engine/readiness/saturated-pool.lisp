;;;; While no worker is free, a request that arrives waits -- in the
;;;; kernel's accept queue or in the readiness set -- and nobody reads it.
;;;; The thread-making thread, at each sweep, does in its place what a
;;;; waiting worker would begin with: it takes new connections off the
;;;; listening socket and looks at what has arrived on parked ones.  A request
;;;; whose head is complete then waits for a worker under the queue
;;;; timeout, in the queue of tasks busy workers run, and is answered 503
;;;; with Retry-After when that passes,
;;;; instead of 408 at the header timeout or nothing at all.  Whatever it
;;;; takes it parks again at once, so the first worker to wait serves it.
;;;; A worker woken for the listening socket while no other is free takes
;;;; the connections queued behind the one it serves in the same way.

(in-package #:hunchentoot-recycling-taskmaster)

(defun no-worker-free-p (engine)
  "True when no worker of ENGINE's pool waits for something to serve."
  (zerop (waiting-worker-count (engine-taskmaster engine))))

(defun queue-for-worker (set connection)
  "CONNECTION's request head has arrived: park it to wait for a worker until
the queue timeout, unless it waits so already; its token goes in the queue
of tasks too, which busy workers run before they wait on the set again:
those whose tasks refill themselves as fast as they are run (an HTTP/2
connection's streams, each begun as another ends) would otherwise not
look at the set before the queue timeout.  A turn the set reports besides
finds it taken, or nothing to read."
  (unless (eql (connection-timeout-status connection) 503)
    (setf (connection-timeout-status connection) 503
          (connection-deadline connection) (+ (get-internal-real-time) (readiness-set-queue-timeout set))))
  (park-until set connection (connection-deadline connection))
  (queue-worker-tasks set (list (connection-token connection))))

(defun wait-for-rest-of-head (set connection)
  "Part of CONNECTION's request head, or none of it, has arrived: park it
until the rest arrives or the header timeout passes."
  (let ((head-started (or (connection-head-started connection)
                          (setf (connection-head-started connection) (get-internal-real-time)))))
    (setf (connection-timeout-status connection) 408)
    (park-until set connection (+ head-started (readiness-set-header-timeout set)))))

(defun look-at-arrived-head (engine set connection)
  "Look at what has arrived on the plain CONNECTION, held by the caller,
behind the octets already pending, and park, refuse or close it by what
that is.  The octets are peeked, not read: left on the socket, they keep
CONNECTION ready, so that the first worker free takes it."
  (let* ((buffer (engine-sweep-buffer engine))
         (pending (connection-pending connection))
         (pending-end (cond (pending (replace buffer pending) (length pending))
                            (t 0)))
         (count (receive-available (connection-fd connection) buffer pending-end (length buffer) :peek t))
         (end (if (integerp count) (+ pending-end count) pending-end)))
    ;; Left on the socket: parked again, it is armed to be reported again.
    (setf (connection-unread-p connection) t)
    (multiple-value-bind (status request-start request-line-end head-end)
        (case (and (acceptor-http2-p (engine-acceptor engine)) (connection-http2-state connection buffer end))
          ;; HTTP/2's preface is no HTTP/1.1 head: its frames wait for a worker.
          (:http2 :complete-http2)
          (:partial :incomplete)
          (t (scan-request-head buffer 0 end (acceptor-max-header-bytes (engine-acceptor engine)))))
      (case status
        (:complete-http2 (queue-for-worker set connection))
        (:complete
         (let ((refused-status (head-refused-status buffer request-start request-line-end head-end)))
           (if refused-status
               (refuse-and-close set connection refused-status)
               (queue-for-worker set connection))))
        (:incomplete
         (cond ((member count '(0 :error))
                ;; The client has gone, or will send no more: no head to answer.
                (close-connection set connection))
               ((zerop end) (park-until set connection (connection-deadline connection)))
               (t (wait-for-rest-of-head set connection))))
        (t (refuse-and-close set connection status))))))

(defun resume-reply-while-saturated (engine set connection)
  "CONNECTION's socket has room for more of its reply: send it, without
waiting, as a worker would, then park it again for the rest, or look at
what the client has sent since."
  (ecase (send-outgoing set connection)
    (:would-block (park-until-writable set connection nil 0))
    (:close (close-connection set connection))
    (:keep-alive
     (setf (connection-deadline connection) (+ (get-internal-real-time) (readiness-set-keep-alive-timeout set)))
     (look-at-arrived-head engine set connection))))

(defun note-ready-connection (engine set connection)
  "CONNECTION, taken by the caller, was reported ready while no worker is
free.  The rest of a reply is sent; for a request, a plain connection is
looked at, and a TLS one cannot be without reading it, so that it has sent
anything counts as a request waiting for a worker."
  (cond ((or (connection-websocket connection) (connection-event-stream connection)
             (connection-http2 connection))
         ;; A websocket's or HTTP/2 connection's frames are read by a
         ;; worker; what is sent to it, or to an event stream, goes now.
         (park-outbox-or-close set connection))
        ((connection-outgoing connection) (resume-reply-while-saturated engine set connection))
        ((or (connection-arriving-body connection) (connection-handshake connection)
             (connection-deferred connection))
         ;; Its body is read, its handshake taken, or its deferred reply
         ;; settled by a worker, under the deadline it was parked with.
         (park-until set connection (connection-deadline connection)))
        ((eql (connection-timeout-status connection) 503)
         (park-until set connection (connection-deadline connection)))
        ((plain-connection-p connection) (look-at-arrived-head engine set connection))
        (t (queue-for-worker set connection))))

(defconstant +accepts-per-report+ 64
  "The most connections taken, besides the first, at one report of the
listening socket while no worker is free (by the sweep, or by the worker
woken for it): under a flood of connections either still returns to what it
was doing.")

(defun accept-waiting-connections (engine set)
  "Take up to +ACCEPTS-PER-REPORT+ connections waiting on SET's listening
socket, which is plain, and park them until their heads arrive."
  (loop repeat +accepts-per-report+
        for connection = (when-accepting (set) (accept-new-connection engine set))
        while connection
        do (if (start-connection-stream engine connection)
               (wait-for-rest-of-head set connection)
               (close-connection set connection))))

(defconstant +long-listen-wait-seconds+ 2/1000
  "A report of the listening socket that came this long after its arming,
while no worker is free, waited behind connections ready before it.  With
one request per connection the socket is nearly all the set reports: its
reports waited under 0.2 ms in over 95 % of turns and 2 ms or more in
fewer than 1 in 4,000; behind 1,000 kept-alive connections busy with 1 ms
handlers, most waited 2 to 20 ms
(bench/profiles/2026-11-26-accepting-behind-a-busy-set.txt).")

(defun take-new-connection (engine set)
  "The connection a worker woken for SET's listening socket is to serve, or
NIL.  When the report waited +LONG-LISTEN-WAIT-SECONDS+ or more and no
worker is free, a plain acceptor's worker takes the connections queued
behind it too (ACCEPT-WAITING-CONNECTIONS): the socket is armed for one
accept at a time, and with every worker busy its next report comes only
after the connections ready before it.  A thousand clients connecting to
a pool busy with kept-alive ones were accepted one per round of the set,
over seconds, their first requests waiting in the kernel's queue
meanwhile (bench/profiles/2026-11-26-accepting-behind-a-busy-set.txt).  A
TLS connection needs its handshake, which the worker that takes it up
does: those wait in the kernel's queue."
  ;; Read before the accept, which arms the socket again.
  (let* ((armed-at (readiness-set-listen-armed-at set))
         (connection (accept-new-connection engine set)))
    (when (and connection
               (no-worker-free-p engine)
               (>= (- (monotonic-microseconds) armed-at)
                   (load-time-value (round (* +long-listen-wait-seconds+ 1000000))))
               (not (hunchentoot:acceptor-ssl-p (engine-acceptor engine))))
      (accept-waiting-connections engine set))
    connection))

(defun sweep-reported-token (engine set token)
  "Take what TOKEN, reported by SET or queued for a worker, stands for as a
worker would, note what it is and park it again.  False when the sweep is
to end: stop, or tasks wait for a worker."
  (cond ((= token +wakeup-token+) nil)
        ((= token +timer-token+) (run-due-timers set (engine-acceptor engine)) t)
        ((= token +task-token+)
         ;; The connections queued beside the tasks are swept as reported
         ;; ones; the tasks are for workers: reported again at once.
         (dolist (queued (take-queued-tokens set))
           (sweep-reported-token engine set queued))
         (rearm-own-descriptor set +task-token+)
         nil)
        ((= token +listen-token+)
         (if (hunchentoot:acceptor-ssl-p (engine-acceptor engine))
             ;; A TLS connection needs its handshake, which a worker does:
             ;; it waits in the accept queue.
             (rearm-listen-socket set)
             (accept-waiting-connections engine set))
         t)
        (t (let ((connection (take-ready-connection set token)))
             (when connection
               (note-ready-connection engine set connection)))
           t)))

(defun sweep-while-no-worker-free (engine set)
  "While no worker is free, take what SET reports ready as a worker would and
note what it is, parking it again.  Ends when a worker is free, nothing is
ready, or every connection could have been seen once: what is parked again
while ready is reported again."
  (loop repeat (+ 2 (readiness-set-connection-count set))
        while (and (no-worker-free-p engine) (not (stopping-p set)))
        do (let ((token (epoll-wait-one (readiness-set-epoll-fd set) 0)))
             (case token
               (:interrupted)
               (:timeout (return))
               (t (unless (sweep-reported-token engine set token)
                    (return)))))))
