;;;; Websockets served by the engine: the handshake, answered in the
;;;; request cycle by a parallel acceptor's dispatch; the connection made a
;;;; websocket once its 101 is sent; and a websocket's turn, what a worker
;;;; does when its client's octets have arrived -- read the frames, answer
;;;; pings and the close, and hand each whole message to the resource
;;;; (websocket-resources.lisp).  A turn ends with the outcome
;;;; :WEBSOCKET (parked by END-TURN, readiness/face.lisp) or :CLOSE, as
;;;; request-cycle.lisp's turns do.  Between turns an idle websocket holds no thread and no
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
               (multiple-value-bind (extension window-bits)
                   (and (acceptor-compression hunchentoot:*acceptor*)
                        (accept-permessage-deflate (cdr (assoc :sec-websocket-extensions headers))))
                 (when extension
                   (setf (hunchentoot:header-out :sec-websocket-extensions) extension))
                 (setf (serving-upgrade *serving*) (make-websocket-upgrade resource client window-bits)))
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

;;; Handing messages on.

(defun deliver-message (websocket opcode octets start end)
  "Hand the message of OPCODE whose payload is the OCTETS from START below
END to WEBSOCKET's resource.  :CLOSE when the resource failed, else NIL."
  (when (note-websocket-message websocket)
    (unless (if (= opcode +text-opcode+)
                (call-resource websocket 'ws:text-message-received (utf-8-octets-string octets start end))
                (call-resource websocket 'ws:binary-message-received (subseq octets start end)))
      :close)))

;;; Frames.

(defstruct (frame-reader (:constructor make-frame-reader (max-message-bytes deflate-p)))
  "Where a websocket's turns are in reading its client's frames: the
holder's alone, kept in the websocket's READER between turns."
  ;; The largest message, octets, from the acceptor: compressed as it
  ;; arrives, and inflated.
  (max-message-bytes 0 :type fixnum :read-only t)
  ;; Whether permessage-deflate was agreed in the handshake.
  (deflate-p nil :read-only t)
  ;; The opcode of the message being read; NIL between messages.
  (message-opcode nil)
  ;; Whether that message is compressed (RSV1 on its first frame).
  (compressed-p nil)
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
  (let ((message-opcode (frame-reader-message-opcode (websocket-reader websocket))))
    (cond ((control-opcode-p opcode) nil)
          ((and (= opcode +continuation-opcode+) (null message-opcode)) 1002)
          ((and (/= opcode +continuation-opcode+) message-opcode) 1002)
          ((> (+ length (websocket-message-length websocket))
              (frame-reader-max-message-bytes (websocket-reader websocket)))
           1009))))

(defun begin-frame (websocket fin-p opcode length mask compressed-p)
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
           (setf (frame-reader-message-opcode reader) opcode
                 (frame-reader-compressed-p reader) compressed-p
                 (frame-reader-utf-8-state reader) 0)
           (begin-websocket-message websocket)))))

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
                 ;; Answered with its code as the websocket closes (END-WEBSOCKET).
                 ((websocket-open-p websocket) (fail-websocket websocket (or code 1000) ""))
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
        (let ((message-opcode (frame-reader-message-opcode reader)))
          ;; A compressed text's UTF-8 is checked once it is inflated.
          (when (and (= message-opcode +text-opcode+) (not (frame-reader-compressed-p reader)))
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
            ((and whole-p fin-p (zerop (websocket-message-length websocket)) (= read 0))
             ;; A message of one frame, all in the buffer: handed on from there.
             (end-message websocket buffer start end))
            ((not (keep-message-octets websocket buffer start end (+ count (frame-reader-left reader))
                                       (- (frame-reader-max-message-bytes reader)
                                          (websocket-message-length websocket))))
             (fail-websocket websocket 1013 "Out of memory"))
            ((and whole-p fin-p)
             (end-message websocket))))))

(defun end-message (websocket &optional octets start end)
  "The last frame of WEBSOCKET's message has arrived: hand the message on,
its payload the OCTETS from START below END when given (none were kept),
else the octets kept of it, inflated when it is compressed, unless a text
ends in the middle of a character (1007).  :CLOSE when the connection is
to close."
  (let* ((reader (websocket-reader websocket))
         (opcode (shiftf (frame-reader-message-opcode reader) nil))
         (kept (end-websocket-message websocket)))
    (unless octets
      (setf octets (or kept (make-array 0 :element-type '(unsigned-byte 8))) start 0 end (length octets)))
    (cond ((frame-reader-compressed-p reader)
           (deliver-inflated-message websocket opcode octets start end))
          ((and (= opcode +text-opcode+) (/= 0 (frame-reader-utf-8-state reader)))
           (fail-websocket websocket 1007 "Invalid UTF-8"))
          (t (deliver-message websocket opcode octets start end)))))

(defun deliver-inflated-message (websocket opcode octets start end)
  "Inflate the compressed message of OPCODE whose payload is the OCTETS from
START below END, each piece of it taken from the memory budget, and hand
it on: 1009 when it inflates past the acceptor's largest message (a
deflate bomb), 1007 when it is not deflate or not UTF-8 text, 1013 when
the budget has no room.  :CLOSE when the connection is to close."
  (let* ((reserved 0)
         (inflated (inflate-octets (worker-inflate-stream) octets start end
                                   (frame-reader-max-message-bytes (websocket-reader websocket))
                                   (lambda (octets)
                                     (when (reserve-message-memory websocket octets)
                                       (incf reserved octets))))))
    (unwind-protect
         (case inflated
           (:too-large (fail-websocket websocket 1009 "Message too big"))
           (:corrupt (fail-websocket websocket 1007 "Invalid compressed data"))
           (:refused (fail-websocket websocket 1013 "Out of memory"))
           (t (if (and (= opcode +text-opcode+) (not (eql 0 (scan-utf-8 0 inflated 0 (length inflated)))))
                  (fail-websocket websocket 1007 "Invalid UTF-8")
                  (deliver-message websocket opcode inflated 0 (length inflated)))))
      (release-message-memory websocket reserved))))

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
             (multiple-value-bind (status fin-p opcode length mask head-end)
                 (parse-frame-head buffer position end (frame-reader-deflate-p reader))
               (case status
                 (:incomplete (return position))
                 (:complete
                  (let ((refusal (frame-sequence-refusal websocket opcode length)))
                    (when refusal
                      (return (fail-websocket websocket refusal (if (eql refusal 1009) "Message too big" "Protocol error")))))
                  (begin-frame websocket fin-p opcode length mask (frame-compressed-p buffer position))
                  (setf position head-end))
                 (t (return (fail-websocket websocket status "Protocol error"))))))))))

;;; A turn.

(defun answer-websocket-frames (serving connection
                                &optional (end (take-pending-bytes connection (serving-buffer serving)
                                                                   (serving-budget serving))))
  "Read what CONNECTION's client has sent, without waiting, after the END
octets at the start of the buffer, and act on its frames.  :WEBSOCKET and
the octets of a frame head that arrived in part, at the buffer's start,
when the connection is to park; :CLOSE when it is to close."
  (let ((websocket (connection-websocket connection))
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
                              (note-websocket-input websocket count)
                              (when (act-on-frames)
                                (return :close))
                              (when (client-reads-slower-than-it-sends-p websocket)
                                (return :websocket)))))
                    finally (return :websocket))))
        (if (eq outcome :websocket)
            (values :websocket end)
            outcome)))))

(defun open-websocket (serving connection end)
  "Make CONNECTION, whose handshake was just answered 101, the websocket of
the serving's WEBSOCKET-UPGRADE, the END octets at the start of the buffer
its first frames; tell the resource (WS:CLIENT-CONNECTED), then act on
what the client has sent.  The turn's outcome."
  (let* ((upgrade (shiftf (serving-upgrade serving) nil))
         (resource (websocket-upgrade-resource upgrade))
         (client (websocket-upgrade-client upgrade))
         (acceptor (serving-acceptor serving))
         (window-bits (websocket-upgrade-deflate-window-bits upgrade))
         (websocket (make-websocket (serving-set serving) connection resource client acceptor
                                    (make-frame-reader (acceptor-max-websocket-message-bytes acceptor)
                                                       (and window-bits t))
                                    window-bits)))
    (setf (client-websocket client) websocket)
    (add-resource-client resource client)
    (if (call-resource websocket 'ws:client-connected)
        (answer-websocket-frames serving connection (or end 0))
        :close)))
