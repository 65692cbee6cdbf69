;;;; Ending connections: closed by their holder, refused with an error
;;;; reply, or ended by the sweeper at their deadline -- 408 for a head that
;;;; did not arrive in time, 503 for a request that found no worker in time,
;;;; a plain close for an idle kept-alive connection or a reply its client
;;;; stopped taking; a websocket pinged or closed with its close frame.

(in-package #:hunchentoot-recycling-taskmaster)

(defun close-connection (set connection)
  "Close CONNECTION, which the caller holds, and forget it.  Errors mean the
client is gone already."
  (remove-connection set connection)
  (drop-pending-bytes connection (readiness-set-memory-budget set))
  (when (connection-websocket connection)
    (end-websocket (connection-websocket connection)))
  (when (connection-deferred connection)
    (detach-deferred-reply set connection))
  (when (connection-event-stream connection)
    (end-event-stream set (connection-event-stream connection)))
  (when (connection-http2 connection)
    (end-http2-connection (connection-http2 connection)))
  (when (connection-outgoing connection)
    (drop-outgoing set connection))
  (when (connection-arriving-body connection)
    (discard-arriving-body set connection))
  (when (connection-handshake connection)
    (end-connection-handshake set connection))
  (let ((stream (connection-stream connection))
        (fd-stream (connection-fd-stream connection)))
    (when (and stream (not (eq stream fd-stream)))
      (ignore-errors (close stream :abort t))
      (forget-tls-errors))
    (ignore-errors (close-connection-fd-stream fd-stream))))

(defun park-outbox-or-close (set connection)
  "Send what waits for CONNECTION's websocket, event stream or HTTP/2
frames, held by the caller, and park it (PARK-WEBSOCKET, PARK-EVENT-STREAM,
PARK-HTTP2-CONNECTION); close it instead when that says it is to close."
  (unless (eq t (cond ((connection-websocket connection) (park-websocket (connection-websocket connection)))
                      ((connection-http2 connection) (park-http2-connection (connection-http2 connection)))
                      (t (park-event-stream (connection-event-stream connection)))))
    (close-connection set connection)))

(defun serve-outbox-output (outbox)
  "Send what waits in OUTBOX, a websocket's or an event stream's, now, when
its connection is parked: the caller takes it, sends, and parks it again,
or closes it when it is to close.  When another thread holds it, that
thread sends before parking."
  (let ((connection (outbox-connection outbox)))
    (when (take-parked-connection connection)
      (park-outbox-or-close (outbox-set outbox) connection))))

(defun refuse-and-close (set connection status &key explanation)
  "Answer CONNECTION's request with the error reply for STATUS and close it;
EXPLANATION, when given, is what its page says instead of what
*HEAD-REFUSALS* says, and the refusal is then counted by the caller.  The
reply and FIN go out before the close, so that the client reads the reply
before the reset that unread input provokes."
  (unless explanation
    (count-refused-head (readiness-set-counters set) status))
  (let ((reply (head-error-reply status (readiness-set-server-name set)
                                 (readiness-set-retry-after-seconds set) explanation))
        (stream (connection-stream connection))
        (fd (connection-fd connection)))
    ;; The sweeper calls this too and must not wait.  Plain text that does
    ;; not fit the socket is dropped; TLS is written only while the socket
    ;; has room (a client that sends and never reads may have filled it).
    (ignore-errors
     (cond ((plain-connection-p connection) (send-without-waiting fd reply))
           ((fd-writable-p fd) (write-sequence reply stream) (finish-output stream))))
    (linger-before-close connection))
  (close-connection set connection)
  (funcall (readiness-set-refusal-logger set) connection status))

(defun peek-arrived-octets (connection)
  "What has arrived on CONNECTION, plain, held by the caller, and is not
read yet: its pending octets, then what its socket has, peeked (left
there).  A vector, and the count of those octets at its start."
  (let* ((pending (or (connection-pending connection) #()))
         (octets (replace (make-array (+ (length pending) 65536) :element-type '(unsigned-byte 8)) pending))
         (count (receive-available (connection-fd connection) octets (length pending) (length octets) :peek t)))
    (values octets (+ (length pending) (if (integerp count) count 0)))))

(defun refuse-in-http2 (set connection status)
  "Refuse CONNECTION, held by the caller, in HTTP/2's frames when it speaks
HTTP/2 (ALPN chose h2, or what arrived on a plain one begins with the
preface) but no worker took it up: HTTP2-REFUSAL-FRAMES, each stream
whose request has arrived answered STATUS (on TLS, whose records only a
worker reads, none: its GOAWAY names none processed), the GOAWAY counted
:REFUSED; then closed.  False, nothing done, when it does not speak it."
  (multiple-value-bind (octets end) (if (plain-connection-p connection)
                                        (peek-arrived-octets connection)
                                        (values #() 0))
    (when (if (plain-connection-p connection)
              (and (>= end (length *http2-preface*)) (not (mismatch *http2-preface* octets :end2 (length *http2-preface*))))
              (equal (connection-application-protocol connection) "h2"))
      (let ((frames (http2-refusal-frames set (coerce octets 'octets) end status))
            (fd (connection-fd connection)))
        (count-http2-goaway (readiness-set-counters set) :refused)
        (ignore-errors
         (if (plain-connection-p connection)
             (send-without-waiting fd frames)
             (when (fd-writable-p fd)
               (write-sequence frames (connection-stream connection))
               (finish-output (connection-stream connection)))))
        (linger-before-close connection)
        (close-connection set connection)
        (funcall (readiness-set-refusal-logger set) connection status)
        t))))

(defun end-parked-connection (set connection)
  "CONNECTION, held by the caller, has reached its deadline: answer it its
TIMEOUT-STATUS, or close it without a word (a kept-alive connection that
sent nothing, a client that took none of its reply)."
  (let ((status (connection-timeout-status connection))
        (counters (readiness-set-counters set)))
    (cond ((connection-handshake connection)
           (atomic-increment (connection-counters-handshake-timeouts counters))
           (close-connection set connection))
          ((connection-deferred connection)
           (end-deferred-reply-at-deadline set connection))
          ((connection-event-stream connection)
           (when (eq (event-stream-deadline-reached (connection-event-stream connection)) :close)
             (close-connection set connection)))
          ((connection-websocket connection)
           (when (eq (websocket-deadline-reached (connection-websocket connection)) :close)
             (close-connection set connection)))
          ((connection-http2 connection)
           (when (eq (http2-deadline-reached (connection-http2 connection)) :close)
             (close-connection set connection)))
          ((connection-arriving-body connection)
           (atomic-increment (connection-counters-body-timeouts counters))
           (count-reply counters 408)
           (refuse-and-close set connection 408 :explanation "The request body did not arrive in time."))
          (status (unless (refuse-in-http2 set connection status)
                    (refuse-and-close set connection status)))
          ((and (connection-outgoing connection) (client-took-octets-p connection))
           ;; The kernel had no room to report all this time, yet the client
           ;; reads: it has the write timeout again.
           (unless (park-connection set connection (+ (get-internal-real-time) (readiness-set-write-timeout set)))
             (close-connection set connection)))
          ((connection-outgoing connection)
           (atomic-increment (connection-counters-write-timeouts counters))
           (close-connection set connection))
          (t (atomic-increment (connection-counters-keep-alive-timeouts counters))
             (close-connection set connection)))))

(defun end-deferred-reply-at-deadline (set connection)
  "CONNECTION, held by the caller, whose reply is deferred, has reached its
deadline: answered its TIMEOUT-STATUS unless the reply was completed
meanwhile, which then goes out (or, waiting for room for it since the
write timeout, never will: closed)."
  (let ((deferred (connection-deferred connection))
        (counters (readiness-set-counters set)))
    (cond ((settle-deferred-reply-outcome deferred :timed-out)
           (let ((status (deferred-reply-timeout-status deferred)))
             (atomic-increment (connection-counters-deferred-timeouts counters))
             (count-reply counters status)
             (refuse-and-close set connection status
                               :explanation "The reply was not ready in time.  Please try again later.")))
          ((or (eq (connection-awaiting connection) :output)
               (not (park-for-completed-reply set connection)))
           (close-connection set connection)))))

(defun close-expired-connections (set)
  "End every parked connection whose deadline has passed: 408 for a head
that did not arrive in time, 503 for a complete request that found no free
worker in time, a plain close for an idle keep-alive connection or a reply
its client stopped taking."
  (let ((now (get-internal-real-time)))
    (map-parked-connections
     set (lambda (connection)
           (when (and (<= (connection-deadline connection) now)
                      (take-parked-connection connection))
             (end-parked-connection set connection))))))

(defun close-parked-connections (set)
  "Close every parked connection at once, for HUNCHENTOOT:STOP; an HTTP/2
one is sent its GOAWAY first."
  (map-parked-connections
   set (lambda (connection)
         (when (take-parked-connection connection)
           (let ((http2 (connection-http2 connection)))
             (when (and http2 (null (http2-connection-goaway http2)))
               (setf (http2-connection-goaway http2) :stop)))
           (close-connection set connection)))))

(defun close-every-connection (set)
  "Close every connection in SET's table, whoever held it: for
ABANDON-ACCEPTOR, once the threads that held them are gone."
  (loop for connection across (readiness-set-slots set)
        when connection
          do (close-connection set connection)))

(defun unfinished-connection-count (set)
  "Connections in SET's table none of whose requests has been answered yet,
or whose reply (or an HTTP/2 stream's) is deferred or not sent whole yet."
  (count-if (lambda (connection)
              (and connection
                   (or (not (connection-answered-p connection))
                       (connection-outgoing connection)
                       (connection-deferred connection)
                       (let ((http2 (connection-http2 connection)))
                         (and http2 (or (plusp (http2-connection-running http2))
                                        (plusp (http2-connection-held http2))))))
                   (not (eq (connection-state connection) :closed))))
            (readiness-set-slots set)))

;;; Relief from memory pressure.

(defun refuse-for-memory (set connection)
  "Answer CONNECTION's request 503 while SET's memory budget holds more
than its limit, counted there, and close it."
  (atomic-increment (memory-budget-refusals (readiness-set-memory-budget set)))
  (count-reply (readiness-set-counters set) 503)
  (refuse-and-close set connection 503
                    :explanation "This server is short of memory for the moment.  Please try again later."))

(defun connection-held-octets (connection)
  "The octets CONNECTION, parked, holds on its client's behalf (counting a
frame it shares with others as its own)."
  (let ((websocket (connection-websocket connection))
        (event-stream (connection-event-stream connection))
        (http2 (connection-http2 connection))
        (outgoing (connection-outgoing connection))
        (body (connection-arriving-body connection))
        (pending (connection-pending connection)))
    (+ (if websocket (+ (websocket-unsent-octets websocket) (websocket-message-length websocket)) 0)
       (if event-stream (event-stream-unsent-octets event-stream) 0)
       (if http2 (+ (http2-connection-unsent-octets http2)
                    (http2-session-held-octets (http2-connection-session http2)))
           0)
       (if outgoing (outgoing-charged outgoing) 0)
       (if (and body (null (arriving-body-file body))) (length (arriving-body-octets body)) 0)
       (if pending (length pending) 0))))

(defun relieve-memory-pressure (set)
  "During an episode of SET's memory budget, close the parked connections
that hold the most, largest first, until its use falls below
+MEMORY-RELIEF-SHARE+ of the limit: clients that take nothing of what
waits for them, or trickle a message or body in.  Websockets close with
1008.  The number closed."
  (let ((budget (readiness-set-memory-budget set))
        (holders '()))
    (when (and (memory-budget-refusing-p budget) (not (memory-relieved-p budget)))
      (map-parked-connections set (lambda (connection)
                                    (let ((held (connection-held-octets connection)))
                                      (when (plusp held)
                                        (push (cons held connection) holders)))))
      (loop for (nil . connection) in (sort holders #'> :key #'car)
            until (memory-relieved-p budget)
            when (take-parked-connection connection)
              count (let ((websocket (connection-websocket connection)))
                      (when websocket
                        (setf (websocket-close-code websocket) 1008
                              (websocket-close-reason websocket) "Out of memory"))
                      (atomic-increment (memory-budget-relief-closes budget))
                      (close-connection set connection)
                      t)))))
