;;;; Websockets served by the engine: the handshake, answered in the
;;;; request cycle by a parallel acceptor's dispatch; the connection made a
;;;; websocket once its 101 is sent; and a websocket's turn, what a worker
;;;; does when its client's octets have arrived -- read the frames, answer
;;;; pings and the close, and hand each whole message to the resource
;;;; (websocket-resources.lisp).  A turn ends with the outcome
;;;; :WEBSOCKET (park it: PARK-WEBSOCKET) or :CLOSE, as request-cycle.lisp's
;;;; turns do.  Between turns an idle websocket holds no thread and no
;;;; buffer: only the octets of a frame head that has partly arrived, and
;;;; a message begun.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +websocket-reads-per-turn+ 16
  "The most reads a worker makes of one websocket before it parks it again,
so that a client sending without pause does not keep a worker from the
others: parked with octets unread, it is reported ready again at once.")

;;; The handshake.

(defun answer-websocket-handshake (resource request)
  "Answer REQUEST, which asks for a websocket on RESOURCE: 101 with its
Sec-WebSocket-Accept (the 101 is sent by SEND-SWITCHING-PROTOCOLS-REPLY and
the connection becomes the websocket once the request is done), or 400, 403
or 426 with what is wrong.  Returns the body, as a dispatched handler."
  (let ((headers (hunchentoot:headers-in request)))
    (multiple-value-bind (status explanation)
        (websocket-handshake-refusal (hunchentoot:request-method request)
                                     (hunchentoot:server-protocol request) headers)
      (cond (status
             (setf (hunchentoot:return-code*) status
                   (hunchentoot:content-type*) "text/plain")
             (when (eql status 426)
               (setf (hunchentoot:header-out :sec-websocket-version) "13"))
             explanation)
            ((not (ws:origin-allowed-p resource (cdr (assoc :origin headers))))
             (setf (hunchentoot:return-code*) hunchentoot:+http-forbidden+
                   (hunchentoot:content-type*) "text/plain")
             "Pages of this origin may not open this websocket.")
            (t
             (let* ((subprotocol (choose-offered-subprotocol (cdr (assoc :sec-websocket-protocol headers))
                                                             (resource-subprotocols resource)))
                    ;; Before the 101: a client class that cannot be made
                    ;; fails the request as a handler's error would (500).
                    (client (apply #'make-instance (resource-client-class resource)
                                   :request request :subprotocol subprotocol
                                   (loop for (name . value) in headers collect name collect value))))
               (setf (hunchentoot:return-code*) hunchentoot:+http-switching-protocols+
                     (hunchentoot:header-out :upgrade) "websocket"
                     (hunchentoot:header-out :connection) "Upgrade"
                     (hunchentoot:header-out :sec-websocket-accept)
                     (websocket-accept-value (cdr (assoc :sec-websocket-key headers))))
               (when subprotocol
                 (setf (hunchentoot:header-out :sec-websocket-protocol) subprotocol))
               (setf (serving-upgrade *serving*) (make-websocket-upgrade resource client))
               ""))))))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor parallel-acceptor) request)
  "A request asking for a websocket on a resource that
*WEBSOCKET-DISPATCH-TABLE* finds gets the websocket handshake
(ANSWER-WEBSOCKET-HANDSHAKE); any other request is dispatched by the next
methods, as on Hunchentoot's acceptors."
  (let ((resource (and *serving*
                       (websocket-upgrade-request-p (hunchentoot:headers-in request))
                       (find-websocket-resource request))))
    (if resource
        (answer-websocket-handshake resource request)
        (call-next-method))))

;;; Calling the resource.

(defun call-resource (websocket function &rest arguments)
  "Call FUNCTION, the name of one of the resource generic functions, on ARGUMENTS with
Hunchentoot's specials bound as in the request that opened WEBSOCKET.
True when it returned; when an error escaped it, the error is logged,
WEBSOCKET is to close with 1011, and NIL is returned."
  (let* ((client (websocket-client websocket))
         (request (ws:client-request client))
         (hunchentoot:*acceptor* (websocket-acceptor websocket))
         (hunchentoot:*request* request)
         (hunchentoot:*session* (hunchentoot:session request)))
    (handler-case (progn (apply function arguments) t)
      (error (condition)
        (log-safely (websocket-acceptor websocket) :error "Error in ~(~A~) of ~A: ~A"
                    function (websocket-resource websocket) condition)
        (fail-websocket websocket 1011 "Internal error")
        nil))))

(defun fail-websocket (websocket code reason)
  "Make WEBSOCKET close with CODE and REASON (RFC 6455 7.1.7): the
turn's outcome, :CLOSE."
  (setf (websocket-close-code websocket) code
        (websocket-close-reason websocket) reason)
  :close)

(defun deliver-message (websocket opcode octets start end)
  "Hand the message of OPCODE whose payload is the OCTETS from START below
END to WEBSOCKET's resource.  :CLOSE when the resource failed, else NIL."
  (atomic-increment (connection-counters-websocket-messages-in (websocket-counters websocket)))
  (when (eq (websocket-state websocket) :open)
    (let ((resource (websocket-resource websocket))
          (client (websocket-client websocket)))
      (unless (if (= opcode +text-opcode+)
                  (call-resource websocket 'ws:text-message-received resource client
                                 (utf-8-octets-string octets start end))
                  (call-resource websocket 'ws:binary-message-received resource client
                                 (subseq octets start end)))
        :close))))

;;; Frames.

(defstruct (frame-reader (:constructor make-frame-reader (max-message-bytes)))
  "Where a websocket's turns are in reading its client's frames: the
holder's alone, kept in the websocket's READER between turns."
  ;; The largest message, octets, from the acceptor.
  (max-message-bytes 0 :type fixnum :read-only t)
  ;; The frame being read: whether its head has been read, then its
  ;; opcode, whether it ends its message, its masking key, the payload
  ;; octets still to come and those read so far.
  (in-frame-p nil)
  (opcode 0 :type fixnum)
  (fin-p nil)
  (mask 0 :type (unsigned-byte 32))
  (left 0 :type fixnum)
  (read 0 :type fixnum)
  ;; The UTF-8 state of a text message's octets so far.
  (utf-8-state 0 :type fixnum)
  ;; The payload of the control frame being read.
  (control nil))

(defun frame-sequence-refusal (websocket opcode length)
  "The code to close WEBSOCKET with when a frame of OPCODE and LENGTH cannot
come now: 1002 for a continuation outside a message or a new message
inside one (RFC 6455 5.4), 1009 for a message over the acceptor's limit;
else NIL."
  (let ((message-opcode (websocket-message-opcode websocket)))
    (cond ((control-opcode-p opcode) nil)
          ((and (= opcode +continuation-opcode+) (null message-opcode)) 1002)
          ((and (/= opcode +continuation-opcode+) message-opcode) 1002)
          ((> (+ length (websocket-message-length websocket))
              (frame-reader-max-message-bytes (websocket-reader websocket)))
           1009))))

(defun begin-frame (websocket fin-p opcode length mask)
  (let ((reader (websocket-reader websocket)))
    (setf (frame-reader-in-frame-p reader) t
          (frame-reader-fin-p reader) fin-p
          (frame-reader-opcode reader) opcode
          (frame-reader-mask reader) mask
          (frame-reader-left reader) length
          (frame-reader-read reader) 0)
    (cond ((control-opcode-p opcode)
           (setf (frame-reader-control reader) (make-array length :element-type '(unsigned-byte 8))))
          ((/= opcode +continuation-opcode+)
           (setf (websocket-message-opcode websocket) opcode
                 (websocket-message-started websocket) (get-internal-real-time)
                 (frame-reader-utf-8-state reader) 0)))))

(defun answer-control-frame (websocket opcode payload)
  "Act on a whole control frame: a ping is answered with a pong of its
payload, a pong is only heard, a close is answered with a close of its
code and ends the websocket.  :CLOSE when the connection is to close."
  (cond ((= opcode +ping-opcode+)
         (note-websocket-ping websocket payload)
         nil)
        ((= opcode +pong-opcode+) nil)
        (t
         (multiple-value-bind (code reason) (parse-close-payload payload 0 (length payload))
           (cond ((eq code :refuse) (fail-websocket websocket reason (if (eql reason 1007) "Invalid UTF-8" "Protocol error")))
                 ((eq (websocket-state websocket) :open)
                  (send-close-frame websocket (or code 1000) "")
                  :close)
                 (t :close))))))

(defun take-payload (websocket buffer start end)
  "Take the octets of BUFFER from START below END, the next of the current
frame's payload: unmask them, check a text message's UTF-8, keep them with
the message or control frame; once the frame is whole, act on it.  :CLOSE
when the connection is to close, else NIL."
  (let* ((reader (websocket-reader websocket))
         (opcode (frame-reader-opcode reader))
         (read (frame-reader-read reader))
         (count (- end start)))
    (unmask-octets buffer start end (frame-reader-mask reader) (logand read 3))
    (if (control-opcode-p opcode)
        (replace (frame-reader-control reader) buffer :start1 read :start2 start :end2 end)
        (let ((message-opcode (websocket-message-opcode websocket)))
          (when (= message-opcode +text-opcode+)
            (let ((state (scan-utf-8 (frame-reader-utf-8-state reader) buffer start end)))
              (unless state
                (return-from take-payload (fail-websocket websocket 1007 "Invalid UTF-8")))
              (setf (frame-reader-utf-8-state reader) state)))))
    (incf (frame-reader-read reader) count)
    (decf (frame-reader-left reader) count)
    (let ((whole-p (zerop (frame-reader-left reader)))
          (fin-p (frame-reader-fin-p reader)))
      (when whole-p
        (setf (frame-reader-in-frame-p reader) nil))
      (cond ((control-opcode-p opcode)
             (when whole-p
               (answer-control-frame websocket opcode (shiftf (frame-reader-control reader) nil))))
            ((and whole-p fin-p (null (websocket-message websocket)) (= read 0))
             ;; A message of one frame, all in the buffer: handed on from there.
             (end-message websocket buffer start end))
            ((not (keep-message-octets websocket buffer start end (+ count (frame-reader-left reader))))
             (fail-websocket websocket 1013 "Out of memory"))
            ((and whole-p fin-p)
             (let ((octets (message-octets (websocket-message websocket))))
               (end-message websocket octets 0 (length octets))))))))

(defun keep-message-octets (websocket buffer start end frame-rest)
  "Keep the octets of BUFFER from START below END, FRAME-REST octets of
their frame being left from START on, with WEBSOCKET's message.  False
when the memory budget had no room for them."
  (add-message-octets (or (websocket-message websocket)
                          (setf (websocket-message websocket) (make-arriving-message)))
                      (readiness-set-memory-budget (websocket-set websocket))
                      buffer start end frame-rest
                      (- (frame-reader-max-message-bytes (websocket-reader websocket))
                         (websocket-message-length websocket))))

(defun end-message (websocket octets start end)
  "The last frame of WEBSOCKET's message has arrived, its payload the
OCTETS from START below END: hand the message on, unless a text ends in
the middle of a character (1007).  :CLOSE when the connection is to close."
  (let ((opcode (websocket-message-opcode websocket)))
    (drop-websocket-message websocket)
    (setf (websocket-message-opcode websocket) nil)
    (if (and (= opcode +text-opcode+) (/= 0 (frame-reader-utf-8-state (websocket-reader websocket))))
        (fail-websocket websocket 1007 "Invalid UTF-8")
        (deliver-message websocket opcode octets start end))))

(defun read-frames (websocket buffer end)
  "Act on the frames in BUFFER below END, their octets having arrived
after what WEBSOCKET has read of them.  The position where the unread
head of a frame begins (END when there is none), or :CLOSE."
  (let ((reader (websocket-reader websocket))
        (position 0))
    (loop
      (cond ((frame-reader-in-frame-p reader)
             (let ((take-end (min end (+ position (frame-reader-left reader)))))
               (when (eq (take-payload websocket buffer position take-end) :close)
                 (return :close))
               (setf position take-end)
               (when (and (= position end) (frame-reader-in-frame-p reader))
                 (return end))))
            (t
             (multiple-value-bind (status fin-p opcode length mask head-end) (parse-frame-head buffer position end)
               (case status
                 (:incomplete (return position))
                 (:complete
                  (let ((refusal (frame-sequence-refusal websocket opcode length)))
                    (when refusal
                      (return (fail-websocket websocket refusal (if (eql refusal 1009) "Message too big" "Protocol error")))))
                  (begin-frame websocket fin-p opcode length mask)
                  (setf position head-end))
                 (t (return (fail-websocket websocket status "Protocol error"))))))))))

;;; A turn.

(defun client-reads-slower-than-it-sends-p (websocket)
  "Send the pongs and what the client's own messages made for it (its
messages echoed or broadcast back) as far as its socket takes them now;
true when half its queue's limit still waits, so that the turn reads no
more of what it sent until it has taken that: a client that sends faster
than it reads is slowed, not closed for the answers to its own messages."
  ;; The pongs first, as at the end of a turn (PARK-WEBSOCKET).
  (queue-websocket-pongs websocket)
  (when (or (websocket-inbox websocket) (websocket-queue websocket))
    (send-websocket-queue websocket))
  (> (websocket-unsent-octets websocket) (floor (websocket-max-queue-bytes websocket) 2)))

(defun answer-websocket-frames (serving connection
                                &optional (end (take-pending-bytes connection (serving-buffer serving)
                                                                   (readiness-set-memory-budget (serving-set serving)))))
  "Read what CONNECTION's client has sent, without waiting, after the END
octets at the start of the buffer, and act on its frames.  :WEBSOCKET when
the connection is to park (with the start of a frame head that arrived in
part), :CLOSE when it is to close."
  (let* ((websocket (connection-websocket connection))
         (counters (websocket-counters websocket))
         (buffer (serving-buffer serving)))
    (flet ((act-on-frames ()
             ;; True when the connection is to close; else the start of a
             ;; frame head that arrived in part is moved to the buffer's start.
             (let ((unread (read-frames websocket buffer end)))
               (or (eq unread :close)
                   (progn (replace buffer buffer :start2 unread :end2 end)
                          (decf end unread)
                          nil)))))
      (let ((outcome
              ;; First the frames that came with the upgrade request, or a
              ;; head that arrived in part.
              (loop initially (when (and (plusp end) (act-on-frames))
                                (return :close))
                    repeat +websocket-reads-per-turn+
                    do (let ((count (receive-bytes connection buffer end (length buffer))))
                         (case count
                           (:would-block (return :websocket))
                           ((0 :error) (return (fail-websocket websocket 1006 "")))
                           (t (incf end count)
                              (atomic-add (connection-counters-websocket-octets-in counters) count)
                              (setf (websocket-last-heard websocket) (get-internal-real-time)
                                    (websocket-pinged-p websocket) nil)
                              (when (act-on-frames)
                                (return :close))
                              (when (client-reads-slower-than-it-sends-p websocket)
                                (return :websocket)))))
                    finally (return :websocket))))
        (when (eq outcome :websocket)
          (keep-pending-bytes connection buffer end (readiness-set-memory-budget (serving-set serving))))
        outcome))))

(defun open-websocket (serving connection end)
  "Make CONNECTION, whose handshake was just answered 101, the websocket of
the serving's WEBSOCKET-UPGRADE, the END octets at the start of the buffer
its first frames; tell the resource (WS:CLIENT-CONNECTED), then act on
what the client has sent.  The turn's outcome."
  (let* ((upgrade (shiftf (serving-upgrade serving) nil))
         (resource (websocket-upgrade-resource upgrade))
         (client (websocket-upgrade-client upgrade))
         (acceptor (serving-acceptor serving))
         (websocket (make-websocket (serving-set serving) connection resource client acceptor
                                    (make-frame-reader (acceptor-max-websocket-message-bytes acceptor)))))
    (setf (client-websocket client) websocket
          (connection-websocket connection) websocket)
    (add-resource-client resource client)
    (if (call-resource websocket 'ws:client-connected resource client)
        (answer-websocket-frames serving connection (or end 0))
        :close)))
