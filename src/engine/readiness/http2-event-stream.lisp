;;;; An HTTP/2 stream whose reply is an event stream (START-EVENT-STREAM in
;;;; a stream's handler, src/event-streams.lisp): its head is sent by the
;;;; handler's worker as on HTTP/1.1, then the stream stays open without a
;;;; worker, and any thread adds its events to the reply's body, which
;;;; leaves as DATA frames under flow control, each event charged to the
;;;; memory budget until the library has taken it.  A timer sends a
;;;; keep-alive comment after each idle interval.  What the client has not
;;;; taken waits up to MAX-QUEUE-BYTES; an event past it resets the stream,
;;;; counted as a stream not read.  CLOSE-EVENT-STREAM ends the body (the
;;;; stream's end, at which EventSource reconnects); the stream's close,
;;;; however it comes, ends the event stream: counted closed at once (a
;;;; channel then drops it at its next publish, should the hooks never
;;;; run, as at STOP), its end hooks called in a worker.
;;;;
;;;; STATE is :OPEN until the end, :CLOSED after; the end is taken once by
;;;; compare-and-swap.  The session's lock orders the events of all the
;;;; threads that send them.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (http2-event-stream (:constructor %make-http2-event-stream))
  "What the engine keeps of an HTTP/2 stream that is an event stream."
  (set nil :read-only t)
  ;; The acceptor it was started on, for its log.
  (acceptor nil :read-only t)
  ;; The HTTP2-CONNECTION and the HTTP2-STREAM.
  (connection nil :read-only t)
  (stream nil :read-only t)
  ;; The octets its client may leave unread before it is reset.
  (max-queue-bytes 0 :type fixnum :read-only t)
  ;; Internal time units between the last octets queued and a keep-alive
  ;; comment; internal real time octets were last queued, any thread
  ;; writing it whole.
  (keep-alive-interval 0 :type fixnum :read-only t)
  (last-queued 0 :type fixnum)
  (timer nil)
  ;; Set by a thread asking for the end (CLOSE-EVENT-STREAM).
  (close-requested-p nil)
  (state :open)
  ;; Functions called with the stream once it has ended, or :ENDED.
  (end-hooks '()))

(defmethod print-object ((stream http2-event-stream) out)
  (print-unreadable-object (stream out :type t :identity t)
    (format out "~S" (http2-event-stream-state stream))))

(defun make-http2-event-stream (set reply-stream acceptor max-queue-bytes keep-alive-seconds)
  "Make the reply written to REPLY-STREAM (an HTTP2-REPLY-STREAM) an
HTTP2-EVENT-STREAM of ACCEPTOR's, counted open among SET's event streams
and its connection's streaming replies until it ends; returns it."
  (let* ((reply (reply-stream-reply reply-stream))
         (connection (http2-reply-connection reply))
         (stream (%make-http2-event-stream :set set :acceptor acceptor :connection connection
                                           :stream (http2-reply-stream reply) :max-queue-bytes max-queue-bytes
                                           :keep-alive-interval (seconds->internal-units keep-alive-seconds)
                                           :last-queued (get-internal-real-time))))
    (atomic-increment (readiness-set-event-stream-count set))
    (atomic-increment (http2-connection-streaming connection))
    (schedule-http2-keep-alive stream)
    (unless (watch-http2-stream-close (http2-connection-session connection) (http2-event-stream-stream stream)
                                      (lambda () (end-http2-event-stream stream)))
      ;; Reset by the client already.
      (end-http2-event-stream stream))
    stream))

(defun schedule-http2-keep-alive (stream)
  "Have STREAM's timer look at it one keep-alive interval after its last octets."
  (let ((due (+ (http2-event-stream-last-queued stream) (http2-event-stream-keep-alive-interval stream))))
    (setf (http2-event-stream-timer stream)
          (schedule-timer (readiness-set-timers (http2-event-stream-set stream))
                          (max 0 (/ (* 1000 (- due (get-internal-real-time))) internal-time-units-per-second))
                          (lambda () (tend-http2-event-stream stream))))))

(defun tend-http2-event-stream (stream)
  "STREAM's timer: a keep-alive comment if it has been idle for its
interval, then the timer again, while it is open."
  (when (eq (http2-event-stream-state stream) :open)
    (when (>= (- (get-internal-real-time) (http2-event-stream-last-queued stream))
              (http2-event-stream-keep-alive-interval stream))
      (queue-http2-event-octets stream *keep-alive-comment* :count-p nil))
    (schedule-http2-keep-alive stream)))

(defun http2-event-stream-open-p (stream)
  (and (eq (http2-event-stream-state stream) :open)
       (not (http2-event-stream-close-requested-p stream))))

(defun queue-http2-event-octets (stream octets &key (count-p t))
  "Add OCTETS, an event (counted sent when COUNT-P) or a comment no one
changes from now on, to STREAM's reply body and send what its connection
has, from any thread.  True when added; false when the stream has ended,
or the octets would pass its MAX-QUEUE-BYTES (it is then reset, counted
as not read) or the memory budget (reset too)."
  (let* ((connection (http2-event-stream-connection stream))
         (session (http2-connection-session connection))
         (http2-stream (http2-event-stream-stream stream))
         (set (http2-event-stream-set stream)))
    (cond ((not (http2-event-stream-open-p stream)) nil)
          ((> (+ (http2-stream-reply-queued http2-stream) (length octets)) (http2-event-stream-max-queue-bytes stream))
           ;; Once, by the sender that sets the flag.
           (when (compare-and-swap (http2-event-stream-close-requested-p stream) nil t)
             (atomic-increment (connection-counters-event-streams-not-reading (readiness-set-counters set)))
             (reset-http2-stream session http2-stream)
             (flush-http2-connection connection))
           nil)
          (t (let ((queued (queue-http2-reply-octets session http2-stream octets :reserve t)))
               (cond ((eq queued t)
                      (setf (http2-event-stream-last-queued stream) (get-internal-real-time))
                      (when count-p
                        (atomic-increment (connection-counters-events-sent (readiness-set-counters set))))
                      (flush-http2-connection connection)
                      t)
                     ((eq queued :no-memory)
                      (when (compare-and-swap (http2-event-stream-close-requested-p stream) nil t)
                        (reset-http2-stream session http2-stream)
                        (flush-http2-connection connection))
                      nil)))))))

(defun close-http2-event-stream (stream)
  "End STREAM's body, from any thread, once what waits for it has been taken."
  (setf (http2-event-stream-close-requested-p stream) t)
  (let ((connection (http2-event-stream-connection stream)))
    (end-http2-reply-body (http2-connection-session connection) (http2-event-stream-stream stream))
    (flush-http2-connection connection)))

(defun end-http2-event-stream (stream)
  "STREAM's HTTP/2 stream has closed (this may be called with its session's
lock held), or its handler failed: counted closed, its timer cancelled; its
end hooks called in a worker soon (an error of theirs logged).  Once."
  (when (compare-and-swap (http2-event-stream-state stream) :open :closed)
    (let ((set (http2-event-stream-set stream)))
      (cancel-timer (http2-event-stream-timer stream))
      (atomic-decrement (readiness-set-event-stream-count set))
      (atomic-decrement (http2-connection-streaming (http2-event-stream-connection stream)))
      (call-soon set (lambda () (call-http2-event-stream-end-hooks stream))))))

(defun call-http2-event-stream-end-hooks (stream)
  (dolist (hook (loop for hooks = (http2-event-stream-end-hooks stream)
                      until (compare-and-swap (http2-event-stream-end-hooks stream) hooks :ended)
                      finally (return (if (listp hooks) hooks '()))))
    (handler-case (funcall hook stream)
      (error (condition)
        (log-safely (http2-event-stream-acceptor stream) :error "Error at the end of an event stream: ~A"
                    condition)))))

(defun add-http2-event-stream-end-hook (stream hook)
  "Call HOOK with STREAM once it has ended, or now if it has.  From any thread."
  (loop for hooks = (http2-event-stream-end-hooks stream)
        do (cond ((eq hooks :ended) (return (funcall hook stream)))
                 ((compare-and-swap (http2-event-stream-end-hooks stream) hooks (cons hook hooks)) (return)))))
