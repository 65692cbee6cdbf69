;;;; Event streams (server-sent events, the text/event-stream of the HTML
;;;; standard): a handler starts one and returns, and any thread sends it
;;;; events without waiting (engine/readiness/event-stream.lisp).  A
;;;; browser's EventSource reads them, and reconnects with the Last-Event-ID
;;;; header once the stream ends.

(in-package #:hunchentoot-recycling-taskmaster)

(defun start-event-stream (&key (keep-alive-seconds 15) max-queue-bytes)
  "Inside a handler of a PARALLEL-ACCEPTOR's request, over HTTP/1.1 or an
HTTP/2 stream: make its reply an event stream, returned as an EVENT-STREAM
(an HTTP2-EVENT-STREAM on HTTP/2) for SEND-EVENT, from any thread.
The handler's return value is ignored; once it returns, its worker sends
the head -- 200, text/event-stream, Cache-Control: no-cache unless set,
the headers and cookies the handler set -- and the stream waits without a
thread.  An idle stream is sent a comment line every KEEP-ALIVE-SECONDS.
What its client has not taken waits, up to MAX-QUEUE-BYTES (by default the
acceptor's MAX-WEBSOCKET-QUEUE-BYTES); a stream that would pass it, or
whose client takes none of it for the write timeout, is closed and
counted (on HTTP/2 the stream is reset).  STOP closes every stream.  Signals REPLY-NOT-DEFERRABLE outside
such a handler or once the headers are sent."
  (let ((serving (serving-of-waiting-reply "an event stream" :http2-p t)))
    (cond ((serving-event-stream serving))
          ((serving-deferred serving)
           (error 'reply-not-deferrable :reason "it is deferred already."))
          (t (check-type keep-alive-seconds (real (0)))
             (let ((connection (worker-connection (serving-worker serving)))
                   (max-queue-bytes (or max-queue-bytes (acceptor-max-websocket-queue-bytes hunchentoot:*acceptor*))))
               (setf (serving-event-stream serving)
                     (if connection
                         (make-event-stream (serving-set serving) connection hunchentoot:*acceptor*
                                            max-queue-bytes keep-alive-seconds)
                         (make-http2-event-stream (serving-set serving) (current-connection-stream)
                                                  hunchentoot:*acceptor* max-queue-bytes keep-alive-seconds))))))))

(defun last-event-id (&optional (request hunchentoot:*request*))
  "The Last-Event-ID header of REQUEST: the id of the last event a
reconnecting EventSource received, or NIL."
  (hunchentoot:header-in :last-event-id request))

(defun check-event-field (name value)
  (when (find-if (lambda (char) (member char '(#\Return #\Newline #\Nul))) value)
    (error 'event-field-refused :field name :value value)))

(defun event-text (data event id retry)
  "The text of an event: its fields, DATA's lines each a data field, and
the blank line that ends it."
  (with-output-to-string (out)
    (when event (format out "event: ~A~%" event))
    (when id (format out "id: ~A~%" id))
    (when retry (format out "retry: ~D~%" retry))
    ;; CR LF, LF and CR each end a line of DATA, as EventSource reads them.
    (loop with start = 0
          for end = (or (position-if (lambda (char) (member char '(#\Return #\Newline))) data :start start)
                        (length data))
          do (format out "data: ~A~%" (subseq data start end))
             (when (>= end (length data))
               (return))
             (setf start (if (and (char= (char data end) #\Return)
                                  (< (1+ end) (length data))
                                  (char= (char data (1+ end)) #\Newline))
                             (+ end 2)
                             (1+ end))))
    (terpri out)))

(defun check-event-fields (event id retry)
  (when event (check-event-field :event (string event)))
  (when id (check-event-field :id (princ-to-string id)))
  (when retry (check-type retry (integer 0))))

(defun event-octets (budget data &key event id retry)
  "The COUNTED-OCTETS of an event, taken from BUDGET, held once, by the
caller, who lets go of them once it has offered them; NIL when BUDGET has
no room.  Signals EVENT-FIELD-REFUSED for an
EVENT or ID with a line break or NUL."
  (check-type data string)
  (check-event-fields event id retry)
  (let* ((text (coerce (event-text data event id retry) 'simple-string))
         (counted (make-counted-octets budget (utf-8-length text))))
    (when counted
      (encode-utf-8-into text (counted-octets-octets counted) 0)
      counted)))

(defun offer-event (stream counted)
  "Offer COUNTED, event octets the caller holds, to STREAM and send them if
it is parked.  True when they were taken."
  (prog1 (offer-event-octets stream counted)
    (serve-outbox-output stream)))

(defun send-event (stream data &key event id retry)
  "Send STREAM an event whose data is the string DATA (each of its lines a
data field), with the EVENT name, ID and RETRY milliseconds when given,
from any thread, without waiting.  True when it is sent or waits to be;
NIL when the stream has ended, or the event does not fit what may wait
for it (the stream is then closed: see START-EVENT-STREAM) or the memory
budget.  Signals EVENT-FIELD-REFUSED for an EVENT or ID with a line break."
  (when (http2-event-stream-p stream)
    (check-type data string)
    (check-event-fields event id retry)
    (return-from send-event
      (queue-http2-event-octets stream (string-utf-8-octets (event-text data event id retry)))))
  (when (event-stream-open-p stream)
    (let ((counted (event-octets (readiness-set-memory-budget (event-stream-set stream)) data
                                 :event event :id id :retry retry)))
      (if counted
          (prog1 (offer-event stream counted)
            (let-go-of-counted-octets counted))
          (progn (refuse-outbox-send stream 1013)
                 (serve-outbox-output stream)
                 nil)))))

(defun close-event-stream (stream)
  "End STREAM, from any thread, once what waits for it has been sent as far
as its socket takes it now."
  (if (http2-event-stream-p stream)
      (close-http2-event-stream stream)
      (progn (setf (event-stream-close-requested-p stream) t)
             (serve-outbox-output stream))))

(defun event-stream-open-p (stream)
  "True until STREAM has ended or been asked to."
  (if (http2-event-stream-p stream)
      (http2-event-stream-open-p stream)
      (and (eq (event-stream-state stream) :open)
           (not (event-stream-close-requested-p stream)))))

(defun on-event-stream-end (stream hook)
  "Call HOOK with STREAM, an event stream of either protocol, once it has
ended, or now if it has.  From any thread."
  (if (http2-event-stream-p stream)
      (add-http2-event-stream-end-hook stream hook)
      (add-event-stream-end-hook stream hook)))
