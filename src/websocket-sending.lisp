;;;; Sending to a websocket client, from any thread: a handler of its own
;;;; or another client's message, a thread of the application's.  Nothing
;;;; here waits on the client: what its socket does not take waits with its
;;;; connection (engine/readiness/websocket-connection.lisp, "Sending from
;;;; any thread").

(in-package #:hunchentoot-recycling-taskmaster)

(defun serve-websocket-output (websocket)
  "Send what waits for WEBSOCKET now, when its connection is parked: the
caller takes it, sends, and parks it again, or closes it when it is to
close.  When another thread holds it, that thread sends before parking."
  (let ((set (websocket-set websocket))
        (connection (websocket-connection websocket)))
    (when (take-parked-connection connection)
      (unless (eq (park-websocket websocket) t)
        (close-connection set connection)))))

(defun send-frame-to-client (client opcode payload)
  "Send CLIENT a frame of OPCODE carrying PAYLOAD.  True when it is sent or
waits to be; NIL when CLIENT is closing or closed, or the frame does not
fit what may wait for it (the client is then closed with 1008)."
  (let ((websocket (client-websocket client)))
    (when websocket
      (let ((offered (offer-websocket-frame websocket (frame-octets opcode payload))))
        (when offered
          (atomic-increment (connection-counters-websocket-messages-out (websocket-counters websocket))))
        ;; Not for a send dropped because the websocket is closing: parking
        ;; it again would put off the end of its wait for the close.
        (when (or offered (websocket-overflowed-p websocket))
          (serve-websocket-output websocket))
        offered))))

(defun ws:send-text-message (client message)
  "Send CLIENT the text MESSAGE, a string, from any thread, without
waiting.  True when it is sent or waits for the client's socket to take
it; NIL when CLIENT is closing or closed, or when the octets waiting for it
would pass the acceptor's :MAX-WEBSOCKET-QUEUE-BYTES (then CLIENT is
closed with 1008)."
  (check-type message string)
  (send-frame-to-client client +text-opcode+ (string-utf-8-octets message)))

(defun ws:send-binary-message (client octets)
  "Send CLIENT the binary message OCTETS, a vector of octets, as
SEND-TEXT-MESSAGE sends text."
  (send-frame-to-client client +binary-opcode+ (coerce octets 'octets)))

(defun ws:send-ping (client &optional (payload #()))
  "Send CLIENT a ping carrying PAYLOAD (at most 125 octets).  The engine
pings silent clients by itself (:WEBSOCKET-PING-INTERVAL)."
  (let ((octets (coerce payload 'octets)))
    (assert (<= (length octets) +max-control-payload-bytes+) (payload)
            "A ping carries at most ~D octets." +max-control-payload-bytes+)
    (send-frame-to-client client +ping-opcode+ octets)))

(defun ws:close-connection (client &key (status 1000) (reason ""))
  "Close CLIENT's websocket with STATUS, a close code, and REASON, from any
thread: what was sent to it before goes first, then the close frame; the
connection ends when the client answers with its own, or after 5 s."
  (assert (sendable-close-code-p status) (status) "~S is not a close code a frame may carry." status)
  (let ((websocket (client-websocket client)))
    (when (and websocket (eq (websocket-state websocket) :open))
      (setf (websocket-close-requested websocket) (list status reason))
      (serve-websocket-output websocket))))

(defun ws:client-open-p (client)
  "True while CLIENT's websocket is open: messages sent to it are sent."
  (let ((websocket (client-websocket client)))
    (and websocket (eq (websocket-state websocket) :open))))

;;; A resource that takes no messages of a kind.

(defmethod ws:text-message-received ((resource ws:websocket-resource) client message)
  (declare (ignore message))
  (ws:close-connection client :status 1003 :reason "No text here"))

(defmethod ws:binary-message-received ((resource ws:websocket-resource) client octets)
  (declare (ignore octets))
  (ws:close-connection client :status 1003 :reason "No binary here"))
