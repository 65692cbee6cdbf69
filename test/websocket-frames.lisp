;;;; RFC 6455 frames, UTF-8 and the handshake's values, as pure functions
;;;; of octets: no socket.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite websocket-frames :in all :description "Websocket frames and handshake values read from octets.")
(in-suite websocket-frames)

(defun octets (&rest values)
  (coerce values '(simple-array (unsigned-byte 8) (*))))

(defun text-octets (string)
  (flex:string-to-octets string :external-format :utf-8))

(defun parse-frame-head-of (octets)
  (multiple-value-list (hrt::parse-frame-head octets 0 (length octets))))

(test websocket-frames.head-lengths-of-7-16-and-64-bits
  (is (equal '(:complete t 1 5 #x01020304 6) (parse-frame-head-of (octets #x81 #x85 1 2 3 4))))
  (is (equal '(:complete nil 2 300 #x0A0B0C0D 8) (parse-frame-head-of (octets #x02 #xFE 1 44 10 11 12 13))))
  (is (equal (list :complete t 2 (expt 2 32) 0 14)
             (parse-frame-head-of (octets #x82 #xFF 0 0 0 1 0 0 0 0 0 0 0 0)))))

(test websocket-frames.incomplete-heads-wait
  (is (equal '(:incomplete) (parse-frame-head-of (octets #x81))))
  (is (equal '(:incomplete) (parse-frame-head-of (octets #x81 #x85 1 2 3))))
  (is (equal '(:incomplete) (parse-frame-head-of (octets #x81 #xFE 1)))))

(test websocket-frames.protocol-errors-refused-with-1002
  (is (equal '(1002) (parse-frame-head-of (octets #xC1 #x80 0 0 0 0))) "RSV1 without an extension")
  (is (equal '(1002) (parse-frame-head-of (octets #x91 #x80 0 0 0 0))) "RSV3")
  (is (equal '(1002) (parse-frame-head-of (octets #x83 #x80 0 0 0 0))) "reserved data opcode 3")
  (is (equal '(1002) (parse-frame-head-of (octets #x8B #x80 0 0 0 0))) "reserved control opcode 11")
  (is (equal '(1002) (parse-frame-head-of (octets #x81 #x05 1 2 3 4 5))) "unmasked client frame")
  (is (equal '(1002) (parse-frame-head-of (octets #x09 #x80 0 0 0 0))) "fragmented ping")
  (is (equal '(1002) (parse-frame-head-of (octets #x89 #xFE 0 126 0 0 0 0))) "ping over 125 octets")
  (is (equal '(1002) (parse-frame-head-of (octets #x82 #xFF #x80 0 0 0 0 0 0 0 0 0 0 0))) "64-bit length, top bit set"))

(test websocket-frames.unmasking-follows-the-phase
  (let ((payload (text-octets "Hello")))
    ;; RFC 6455 5.7: "Hello" masked with 37 fa 21 3d.
    (let ((masked (octets #x7f #x9f #x4d #x51 #x58)))
      (is (equalp payload (hrt::unmask-octets (copy-seq masked) 0 5 #x37fa213d 0)))
      (let ((split (copy-seq masked)))
        (hrt::unmask-octets split 0 2 #x37fa213d 0)
        (hrt::unmask-octets split 2 5 #x37fa213d 2)
        (is (equalp payload split))))))

(test websocket-frames.server-frames-are-unmasked-and-final
  (is (equalp (octets #x81 5 72 101 108 108 111) (hrt::frame-octets 1 (text-octets "Hello"))))
  (let ((frame (hrt::frame-octets 2 (make-array 300 :element-type '(unsigned-byte 8) :initial-element 7))))
    (is (equalp (octets #x82 126 1 44) (subseq frame 0 4)))
    (is (= 304 (length frame))))
  (let ((frame (hrt::frame-octets 2 (make-array 70000 :element-type '(unsigned-byte 8)))))
    (is (equalp (octets #x82 127 0 0 0 0 0 1 #x11 #x70) (subseq frame 0 10)))))

(test websocket-frames.utf-8-checked-as-it-arrives
  (flet ((scan (&rest values) (hrt::scan-utf-8 0 (apply #'octets values) 0 (length values))))
    (is (eql 0 (scan #x48 #xC3 #xA9 #xE2 #x82 #xAC #xF0 #x9F #x98 #x80)) "ASCII, é, €, an emoji")
    (is (plusp (scan #xE2 #x82)) "a character begun")
    (is (null (scan #xC0 #x80)) "overlong")
    (is (null (scan #xED #xA0 #x80)) "surrogate")
    (is (null (scan #xF4 #x90 #x80 #x80)) "past U+10FFFF")
    (is (null (scan #xCE #xBA #xE1 #xBD #xB9 #xCF #x83 #xCE #xBC #xCE #xB5 #xED #xA0 #x80 #x65 #x64 #x69 #x74 #x65 #x64))
        "Autobahn 6.3.1: fails at the surrogate, before the end")
    (is (null (scan #xFF)) "never in UTF-8")
    (let ((state (hrt::scan-utf-8 0 (octets #xF0 #x9F) 0 2)))
      (is (eql 0 (hrt::scan-utf-8 state (octets #x98 #x80) 0 2)) "a character split between fragments"))))

(test websocket-frames.close-payloads
  (is (equal '(1000 "bye") (multiple-value-list (hrt::parse-close-payload (octets 3 232 98 121 101) 0 5))))
  (is (equal '(nil "") (multiple-value-list (hrt::parse-close-payload (octets) 0 0))))
  (is (equal '(:refuse 1002) (multiple-value-list (hrt::parse-close-payload (octets 3) 0 1))) "one octet")
  (dolist (code '(0 999 1004 1005 1006 1015 1016 2999 5000))
    (is (equal '(:refuse 1002) (multiple-value-list (hrt::parse-close-payload (octets (ash code -8) (logand code 255)) 0 2)))
        "code ~D may not be sent" code))
  (dolist (code '(1000 1001 1002 1003 1007 1008 1009 1010 1011 3000 4999))
    (is (eql code (hrt::parse-close-payload (octets (ash code -8) (logand code 255)) 0 2)) "code ~D may be sent" code))
  (is (equal '(:refuse 1007) (multiple-value-list (hrt::parse-close-payload (octets 3 232 #xC0 #x80) 0 4))) "reason not UTF-8")
  (let ((payload (hrt::close-payload 1001 (make-string 200 :initial-element #\é))))
    (is (<= (length payload) 125))
    (is (eql 1001 (hrt::parse-close-payload payload 0 (length payload))) "a long reason is cut between characters")))

(test websocket-frames.handshake-values
  ;; RFC 6455 1.3's example.
  (is (equal "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" (hrt::websocket-accept-value "dGhlIHNhbXBsZSBub25jZQ==")))
  (is (hrt::websocket-upgrade-request-p '((:upgrade . "WebSocket") (:connection . "keep-alive, Upgrade"))))
  (is (not (hrt::websocket-upgrade-request-p '((:upgrade . "h2c") (:connection . "Upgrade")))))
  (is (equal "chat" (hrt::choose-offered-subprotocol "superchat, chat" '("chat" "superchat"))))
  (is (null (hrt::choose-offered-subprotocol "mqtt" '("chat"))))
  (let ((good '((:sec-websocket-key . "dGhlIHNhbXBsZSBub25jZQ==") (:sec-websocket-version . "13"))))
    (is (null (hrt::websocket-handshake-refusal :get :http/1.1 good)))
    (is (eql 400 (hrt::websocket-handshake-refusal :post :http/1.1 good)))
    (is (eql 400 (hrt::websocket-handshake-refusal :get :http/1.0 good)))
    (is (eql 400 (hrt::websocket-handshake-refusal :get :http/1.1 '((:sec-websocket-key . "short") (:sec-websocket-version . "13")))))
    (is (eql 426 (hrt::websocket-handshake-refusal :get :http/1.1 '((:sec-websocket-key . "dGhlIHNhbXBsZSBub25jZQ==") (:sec-websocket-version . "8")))))))

(test websocket-frames.key-is-sixteen-octets-of-ascii-base64
  (is-true (hrt::websocket-key-valid-p "dGhlIHNhbXBsZSBub25jZQ=="))
  (is-true (hrt::websocket-key-valid-p "AAAAAAAAAAAAAAAAAAAA+/=="))
  (dolist (key (list "dGhlIHNhbXBsZSBub25jZé==" ; a Latin letter that ALPHANUMERICP takes
                     (concatenate 'string "dGhlIHNhbXBsZSBub25jZ" (string (code-char #xFF21)) "==") ; fullwidth A
                     (concatenate 'string "dGhlIHNhbXBsZSBub25jZ" (string (code-char #x0661)) "==") ; Arabic-Indic 1
                     "dGhlIHNhbXBsZSBub25j-Q==" "dGhlIHNhbXBsZSBub25jZQ=" "dGhlIHNhbXBsZSBub25jZQQ="))
    (is-false (hrt::websocket-key-valid-p key) "~S is not 16 octets of base64" key)))

(test websocket-frames.upgrade-request-with-a-body-refused
  (dolist (body-header '((:transfer-encoding . "chunked") (:content-length . "5")))
    (is (eql 400 (hrt::websocket-handshake-refusal
                  :get :http/1.1 (list body-header '(:sec-websocket-key . "dGhlIHNhbXBsZSBub25jZQ==")
                                       '(:sec-websocket-version . "13"))))
        "~S" body-header))
  (is (null (hrt::websocket-handshake-refusal
             :get :http/1.1 '((:content-length . "0") (:sec-websocket-key . "dGhlIHNhbXBsZSBub25jZQ==")
                              (:sec-websocket-version . "13"))))))

(test websocket-frames.utf-8-encoded-to-measure
  (dolist (string (list "" "Hello" "héllo wörld" (coerce (list (code-char #x10348) #\a (code-char #x20AC)) 'string)))
    (let* ((simple (coerce string 'simple-string))
           (octets (make-array (hrt::utf-8-length simple) :element-type '(unsigned-byte 8))))
      (hrt::encode-utf-8-into simple octets 0)
      (is (equalp (text-octets string) octets) "~S" string)
      (is-true (hrt::utf-8-encodes-p simple octets 0))
      (when (plusp (length octets))
        (is-false (hrt::utf-8-encodes-p simple (subseq octets 1) 0) "~S: other octets" string)))))
